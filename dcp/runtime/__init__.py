"""Executing plans on megatron-core: process groups (``groups``), the zig-zag shard layout
(``layout``), reading a rank's shards (``dispatch``), the micro-step loop (``schedule``), the
model + DDP + optimizer that runs it (``runtime``) and the ten-line API (``engine``)."""
