"""API process: the asyncio front, its replicas (engine-core process client or thread, restarted when they die), output assembly, the served weights' state."""
