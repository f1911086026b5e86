"""The engine, one sub-package per process its code runs in (docs/ARCHITECTURE.md): ``front``
(API process), ``core`` (engine-core process), ``worker`` (one device rank), ``cpu`` (CPU
tuning); here the request types, the front/core wire format, what both processes use (the
detokenizer, routed-experts replay) and ``LLM``."""
