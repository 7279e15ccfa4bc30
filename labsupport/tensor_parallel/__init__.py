"""Chapter 4, tensor parallelism.

- ``tensor_parallel``: the lesson (Megatron's f/g, column/row linears, SP, vocab-parallel embedding);
- ``gpt``: the shared decoder split by tensor parallelism (used by chapter 8 and the capstone);
- ``probe``: the collectives of a TP layer by phase, read from ``labsupport.calls``;
- ``crossing``: a TP MLP's matmuls beside g's all-reduce;
- ``checks``: the your-turn checks; ``bench``: ``python -m labsupport.bench tp``.

This package re-exports the lesson (the names the chapter defines).
"""
from labsupport.tensor_parallel.tensor_parallel import (all_reduce, all_gather,
                                                        reduce_scatter, my_chunk,
                                                        CopyToTP, ReduceFromTP,
                                                        GatherFromSP, ReduceScatterToSP,
                                                        GatherLastDim, enter_tp,
                                                        exit_tp, ColumnParallelLinear,
                                                        RowParallelLinear,
                                                        masked_lookup,
                                                        VocabParallelEmbedding,
                                                        TensorParallelBlock,
                                                        dtensor_tp_plan,
                                                        dtensor_sp_plan,
                                                        parallelize_dtensor)
