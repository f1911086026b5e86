"""rlserve: an LLM inference server for RL post-training."""

__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing rlserve must not import torch-heavy modules
    if name == "LLM":
        from rlserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from rlserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "__version__"]
