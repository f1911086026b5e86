"""The server process's side of weight sync: the manager (HTTP -> engine core -> TP workers), the receiver, the worker functions, liveness."""
