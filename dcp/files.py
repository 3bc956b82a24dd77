"""Reading a file someone else may have written: bounded, parsed without surprises, and any
problem reported as one ``FileContentError`` (a ``ValueError``: exit code 2) naming the file.

Every file DCP reads goes through here: run configs, cost-model specs, lengths files,
checkpoint manifests and pointers, dataset metadata, Hugging Face configs, records. The rules:

- **Size first.** A file larger than its limit is refused by its size, before a byte is read
  (one growing past it while read, once it has); memory holds what the file holds, never the
  limit. Only regular files are read, checked before anything wraps the descriptor: a
  directory, a FIFO, a device or ``/dev/zero`` is one line, never a block, a fill or an
  ``IsADirectoryError``. Files of lines are streamed, each line bounded; a reader that keeps
  what it reads bounds the file too (``dcp.observability.metrics.MAX_FILE_VALUES``).
- **Numbers JSON can hold.** ``NaN``/``Infinity``, floats that overflow to infinity (``1e400``)
  and integers beyond 64 bits are refused while parsing, not after.
- **Bounded nesting.** Lists and mappings nest at most ``MAX_NESTING`` deep (DCP's own files
  nest four), so no reader recurses out of the stack.
- **One value per key.** A YAML mapping that gives a key twice is refused (PyYAML would keep
  the last one silently).
- **YAML aliases are counted, not expanded.** A YAML document is composed into its node graph
  (an alias is the same node again, so composing costs what the text costs), and the values it
  would expand to are counted on that graph before anything is constructed: a "billion laughs"
  file of a few hundred bytes is refused in milliseconds. Recursive aliases are refused.
  ``check_tree`` does the same for data already in memory (what ``torch.load`` rebuilds from a
  pickle's memo references): each shared object visited once, its uses counted.
- **Shape errors name the file.** ``reading(path, what)`` wraps the code that interprets a
  file's data: a wrong type or shape (the ``TypeError``, ``KeyError``, ``AttributeError`` or bare
  ``int()`` error it causes) becomes one line naming the file. Wrap only that code, so a bug
  elsewhere keeps its traceback.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Callable, Hashable, Iterator
from typing import Any, BinaryIO

import yaml

MAX_CONFIG_BYTES = 4 << 20
"""Run configs, cost-model specs, manifests, metadata, Hugging Face ``config.json``: each is a
few KiB; 4 MiB leaves room for generated ones."""
MAX_NESTING = 64
"""Deepest list/mapping nesting any file DCP reads may have."""
MAX_YAML_VALUES = 100_000
"""Values (scalars, lists, mappings) a YAML document may expand to once aliases are followed."""
MAX_LINE_BYTES = 1 << 20
"""Longest line of a JSON-lines file (records, lengths)."""
_MAX_INT_DIGITS = 19
"""64-bit integers: 2**63 - 1 has 19 digits; no DCP file holds a wider number."""


class FileContentError(ValueError):
    """A file's content is refused: ``"<file>: <what is wrong>"``, one line."""


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(source: str | os.PathLike[str], problem: str) -> FileContentError:
    return FileContentError(f"{source}: {_one_line(problem)}")


def _open_regular(path: str | os.PathLike[str], what: str) -> BinaryIO:
    """``path`` opened for reading if it is a regular file."""
    try:
        # O_NONBLOCK: opening a FIFO never waits for a writer; it is refused just below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _fail(path, f"does not exist (expected a {what})") from None
    except OSError as exc:
        raise _fail(path, f"cannot read the {what}: {exc.strerror or exc}") from None
    # The type is checked on the descriptor before Python wraps it: ``fdopen`` of a directory
    # raises its own IsADirectoryError naming the descriptor number.
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise _fail(path, f"{kind} (expected a {what})")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file ``path``, refused when larger than ``max_bytes``; ``what``
    says what the file should be ("cost-model spec") in the errors."""
    with _open_regular(path, what) as f:
        # ``read(n)`` allocates n bytes before it reads: ask for what the file holds (plus one
        # byte, to see it grow), never the whole limit.
        expected = os.fstat(f.fileno()).st_size
        if expected > max_bytes:
            raise _fail(path, f"larger than {_size(max_bytes)}; not a {what}")
        try:
            data = f.read(expected + 1)
            if len(data) > expected:
                data += f.read(max_bytes - expected)
        except OSError as exc:
            raise _fail(path, f"cannot read the {what}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise _fail(path, f"larger than {_size(max_bytes)}; not a {what}")
    return data


def read_text(path: str | os.PathLike[str], *, what: str, max_bytes: int) -> str:
    """``read_bytes`` decoded as UTF-8."""
    return _decode(read_bytes(path, what=what, max_bytes=max_bytes), path, what)


def _decode(data: bytes, source: str | os.PathLike[str], what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        problem = f"not UTF-8 text ({exc.reason} at byte {exc.start}); not a {what}"
        raise _fail(source, problem) from None


def _size(num_bytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if num_bytes >= 1 << shift:
            return f"{num_bytes / (1 << shift):g} {unit}"
    return f"{num_bytes} bytes"


# ---------------------------------------------------------------------------- JSON


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise ValueError(f"integer {text[:24]}... is out of the 64-bit range")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:24]} is out of the floating-point range")
    return value


def _parse_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a JSON number")


def parse_json(text: str, *, source: str | os.PathLike[str], max_nesting: int = MAX_NESTING):
    """``text`` as JSON under the module's rules; ``source`` names it in errors."""
    try:
        data = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}"
        raise _fail(source, f"not valid JSON ({exc.msg} at {where})") from None
    except RecursionError:
        raise _fail(source, f"nested deeper than {max_nesting} levels") from None
    except ValueError as exc:  # from the number hooks
        raise _fail(source, f"not valid JSON ({exc})") from None
    check_tree(data, source=source, max_nesting=max_nesting)
    return data


def load_json(
    path: str | os.PathLike[str],
    *,
    what: str,
    max_bytes: int = MAX_CONFIG_BYTES,
    max_nesting: int = MAX_NESTING,
) -> Any:
    """The JSON document in the file ``path`` (``read_bytes``, then ``parse_json``)."""
    return parse_json(
        read_text(path, what=what, max_bytes=max_bytes), source=path, max_nesting=max_nesting
    )


def iter_lines(
    path: str | os.PathLike[str], *, what: str, max_line_bytes: int = MAX_LINE_BYTES
) -> Iterator[tuple[int, str]]:
    """``(1-based line number, text)`` of every line of ``path``, the line end kept (a last
    line without one is what a writer killed mid-line leaves); a line longer than
    ``max_line_bytes`` is refused, so memory stays bounded by one line."""
    with _open_regular(path, what) as f:
        for number, raw in enumerate(iter(lambda: f.readline(max_line_bytes + 1), b""), 1):
            if len(raw) > max_line_bytes:
                raise _fail(path, f"line {number} is longer than {_size(max_line_bytes)}")
            if not raw.endswith(b"\n"):  # cut mid-write, maybe inside a character
                yield number, raw.decode("utf-8", errors="replace")
                continue
            yield number, _decode(raw, f"{path}:{number}", what)


_CONTAINERS = (dict, list, tuple, set, frozenset)


def check_tree(
    data: Any,
    *,
    source: str | os.PathLike[str],
    max_values: int | None = None,
    max_nesting: int = MAX_NESTING,
) -> int:
    """The number of values ``data`` (plain lists, tuples, dicts and sets, anything else a leaf)
    holds when every shared reference is followed, as a reader walking it as a tree would meet
    them; refused when it is above ``max_values`` (``None``: no limit), deeper than
    ``max_nesting`` or holds itself. Each container is visited once, so the check costs what
    the objects in memory cost, however many times the tree repeats them."""
    if not isinstance(data, _CONTAINERS):
        return 1
    return _count_graph(
        data,
        _data_children,
        source=source,
        max_values=max_values,
        max_nesting=max_nesting,
        shared="shared references repeated inside each other",
    )


def _data_children(value: Any) -> tuple[int, list[Any]]:
    if isinstance(value, dict):
        inner = [v for v in value.values() if isinstance(v, _CONTAINERS)]
        inner += [k for k in value if isinstance(k, tuple | frozenset)]
        return 2 * len(value), inner
    return len(value), [v for v in value if isinstance(v, _CONTAINERS)]


def _count_graph(
    root: Any,
    children_of: Callable[[Any], tuple[int, list[Any]]],
    *,
    source: str | os.PathLike[str],
    max_values: int | None,
    max_nesting: int,
    shared: str,
) -> int:
    """The number of values under the container ``root`` and how deep containers nest in it,
    over the graph that ``children_of`` draws (a container's number of children, and those of
    them that are containers), each container counted once per use but visited once: its
    numbers come from its children's. ``shared`` says, in the refusal, what makes a small input
    expand past ``max_values``."""
    counts: dict[int, int] = {}
    heights: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, tuple[int, list[Any]] | None]] = [(root, None)]
    while stack:
        current, children = stack.pop()
        key = id(current)
        if children is not None:  # its children are done
            on_path.discard(key)
            num_children, inner = children
            count = 1 + num_children - len(inner) + sum(counts[id(c)] for c in inner)
            height = 1 + max((heights[id(c)] for c in inner), default=0)
            counts[key], heights[key] = count, height
            if max_values is not None and count > max_values:
                raise _fail(source, f"expands to more than {max_values} values ({shared})")
            if height > max_nesting:
                raise _fail(source, f"nested deeper than {max_nesting} levels")
            continue
        if key in counts:
            continue
        if key in on_path:
            raise _fail(source, "holds a value that contains itself")
        on_path.add(key)
        children = children_of(current)
        stack.append((current, children))
        stack.extend((c, None) for c in children[1] if id(c) not in counts)
    return counts[id(root)]


# ---------------------------------------------------------------------------- YAML


def yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: what the YAML parser found wrong, and where (1-based line and column)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        context = f"{exc.context}: " if exc.context else ""
        return f"{context}{exc.problem} at line {mark.line + 1}, column {mark.column + 1}"
    if isinstance(exc, yaml.reader.ReaderError) and isinstance(exc.character, int):
        return f"unacceptable character #x{exc.character:04x} at position {exc.position}"
    return _one_line(str(exc))


def parse_yaml(
    text: str,
    *,
    source: str | os.PathLike[str],
    max_values: int = MAX_YAML_VALUES,
    max_nesting: int = MAX_NESTING,
) -> Any:
    """``text`` as one YAML document (safe types only), refused before construction when its
    aliases expand to more than ``max_values`` values or it nests deeper than ``max_nesting``.

    ``yaml.YAMLError`` propagates (callers word it: "not valid YAML", "override ... not valid").
    """
    loader = _SafeUniqueKeysLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise _fail(source, f"nested deeper than {max_nesting} levels") from None
        if node is None:
            return None
        if isinstance(node, yaml.CollectionNode):
            _count_graph(
                node,
                _yaml_children,
                source=source,
                max_values=max_values,
                max_nesting=max_nesting,
                shared="YAML aliases repeated inside each other; write the values out",
            )
        try:
            return loader.construct_document(node)
        except (ValueError, OverflowError) as exc:  # e.g. an integer of 5000 digits
            raise _fail(source, f"holds a value that cannot be read ({exc})") from None
    finally:
        loader.dispose()


class _SafeUniqueKeysLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last
    silently, so a setting written twice would quietly replace the other). Keys a merge
    (``<<: *base``) brings in may be overridden: that is what merging is for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, Hashable):
                    continue  # the base constructor refuses it, with its own words
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"found the key {key!r} a second time",
                        key_node.start_mark,
                    )
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _yaml_children(node: yaml.Node) -> tuple[int, list[yaml.Node]]:
    if isinstance(node, yaml.SequenceNode):
        return len(node.value), [n for n in node.value if isinstance(n, yaml.CollectionNode)]
    nodes = [n for pair in node.value for n in pair]
    return len(nodes), [n for n in nodes if isinstance(n, yaml.CollectionNode)]


def load_yaml(path: str | os.PathLike[str], *, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> Any:
    """The YAML document in the file ``path`` (``read_text``, then ``parse_yaml``); invalid
    YAML is one ``FileContentError`` line with the parser's problem and position."""
    text = read_text(path, what=what, max_bytes=max_bytes)
    try:
        return parse_yaml(text, source=path)
    except yaml.YAMLError as exc:
        raise _fail(path, f"not valid YAML ({yaml_problem(exc)})") from None


# ---------------------------------------------------------------------------- shapes

SHAPE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    KeyError,
    AttributeError,
    IndexError,
    OverflowError,
    RecursionError,
)
"""What code interpreting plain data (dicts, lists, strings, numbers) raises on a wrong shape."""


@contextlib.contextmanager
def reading(path: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Inside the block, a ``SHAPE_ERRORS`` error becomes one ``FileContentError`` line naming
    ``path``: a ``ValueError`` keeps its words (``"<path>: <what>: <message>"``, or as it is when
    it names ``path`` already), any other is a wrong shape (``"<path>: not a valid <what>:
    TypeError: ..."``)."""
    try:
        yield
    except FileContentError:
        raise
    except SHAPE_ERRORS as exc:
        text = _one_line(str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc))
        if text.startswith(str(path)):
            raise FileContentError(text) from None
        if isinstance(exc, ValueError) and text:
            raise _fail(path, f"{what}: {text}") from None
        if isinstance(exc, KeyError):
            text = f"missing key {text!r}"
        elif text:
            text = f"{type(exc).__name__}: {text}"
        raise _fail(path, f"not a valid {what}: {text or type(exc).__name__}") from None


# ---------------------------------------------------------------------------- writing


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: str | os.PathLike[str], target: str | os.PathLike[str]) -> None:
    """Give the finished file ``tmp`` (a sibling of ``target``) its final name: its bytes
    fsynced, then renamed over ``target`` and the directory fsynced, so a reader sees the old
    file or the whole new one, before and after a crash."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, target)
    fsync_dir(os.path.dirname(os.path.abspath(target)))


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary sibling and ``publish``; the one way DCP
    replaces a file others may read. An ``OSError`` names ``path``."""
    target = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(target))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
        publish(tmp, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OSError(exc.errno, exc.strerror, target) from None
