"""Scale-out: many rlserve servers behind a router, placed by Ray, synced by one trainer."""
