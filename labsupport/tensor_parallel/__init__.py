"""Chapter 4, tensor parallelism.

- ``tensor_parallel``: the lesson (Megatron's f/g, column/row linears, SP, vocab-parallel
  embedding);
- ``gpt``: the shared decoder split by tensor parallelism (used by chapter 8 and the capstone);
- ``probe``: the collectives of a TP layer by phase, read from ``labsupport.calls``;
- ``crossing``: a TP MLP's matmuls beside g's all-reduce;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench tp``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.tensor_parallel.tensor_parallel import (
    ColumnParallelLinear,
    CopyToTP,
    GatherFromSP,
    GatherLastDim,
    ReduceFromTP,
    ReduceScatterToSP,
    RowParallelLinear,
    TensorParallelBlock,
    VocabParallelEmbedding,
    all_gather,
    all_reduce,
    dtensor_sp_plan,
    dtensor_tp_plan,
    enter_tp,
    exit_tp,
    masked_lookup,
    my_chunk,
    parallelize_dtensor,
    reduce_scatter,
)

__all__ = ["ColumnParallelLinear", "CopyToTP", "GatherFromSP", "GatherLastDim", "ReduceFromTP",
           "ReduceScatterToSP", "RowParallelLinear", "TensorParallelBlock",
           "VocabParallelEmbedding", "all_gather", "all_reduce", "dtensor_sp_plan",
           "dtensor_tp_plan", "enter_tp", "exit_tp", "masked_lookup", "my_chunk",
           "parallelize_dtensor", "reduce_scatter"]
