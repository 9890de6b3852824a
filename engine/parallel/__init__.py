"""Parallelism on torch.distributed: tensor parallelism (:mod:`.tensor_parallel`)."""
