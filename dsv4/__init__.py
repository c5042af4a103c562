"""dsv4: a DeepSeek-V4 inference engine with a pure-PyTorch oracle of the official numerics."""
__version__ = "0.1.0"


def __getattr__(name):
    # lazy: `import dsv4` stays cheap for the CLI and tools
    if name == "LLM":
        from .engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]
