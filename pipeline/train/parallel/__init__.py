"""Process groups and layouts: groups (init and teardown of torch.distributed and Megatron's parallel state),
context_parallel (splitting a micro-batch's sequence across CP ranks) and compat (the CPU patches Megatron-Core
needs under gloo; docs/dependencies.md lists them).
"""
