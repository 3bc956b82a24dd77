"""Executing plans on megatron-core: process groups (``groups``), reading a rank's shards of
the zig-zag layout (``dispatch``; the layout itself is ``dcp.attention.layout``), the micro-step
loop (``schedule``), the model + DDP + optimizer that runs it (``runtime``) and the ten-line API
(``engine``)."""
