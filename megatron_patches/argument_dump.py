"""Let a script decide whether megatron-core 0.19.2's argument validation lists every argument.

Why upstream can't: ``megatron.training.arguments.validate_args`` ends with
``_print_args("arguments", args)`` unconditionally: on rank 0 some 830 lines, one per argument,
on every run, with no flag to turn it off. ``argument_dump_if(flag)`` makes that call print
only when the parsed arguments have ``flag`` set (``--dcp-print-args``), inside the block only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from megatron_patches._version import require_supported_megatron


@contextlib.contextmanager
def argument_dump_if(flag: str) -> Iterator[None]:
    """Inside the block, megatron lists its arguments only when ``args.<flag>`` is true."""
    require_supported_megatron("argument_dump")
    from megatron.training import arguments

    original = arguments._print_args

    def print_if_asked(title, args) -> None:
        if getattr(args, flag, False):
            original(title, args)

    arguments._print_args = print_if_asked
    try:
        yield
    finally:
        arguments._print_args = original
