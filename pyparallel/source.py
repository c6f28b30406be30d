"""What a module class's ``forward`` does, read from its source with :mod:`ast`: which ``self`` attributes
and ``self.config`` entries it reads, and how it cuts a child's output.

Splitting a model is only exact if the pieces reproduce what the model's own forward does around them.
Reading the forward's source lets a split refuse a class it has never seen when that class does something
the split would drop (Granite's embedding multiplier, Phi-3's slicing of a fused projection): a false alarm
is a refusal, never a silently different model. Used by the tensor-parallel styles and plans and by the
pipeline's Hugging Face blocks.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

SPLITTERS = ("chunk", "split", "tensor_split", "unbind", "unflatten")


@functools.cache
def forward_tree(cls: type) -> ast.AST | None:
    """The parsed source of ``cls.forward`` (decorators included), or None when it cannot be read."""
    forward = getattr(cls, "forward", None)
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _is_self_call(node: ast.AST, attr: str) -> bool:
    """``self.<attr>(...)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == attr
            and _is_self(node.func.value))


@functools.cache
def output_cuts(cls: type, attr: str) -> tuple[str, ...]:
    """How ``cls.forward`` cuts the output of ``self.<attr>(...)`` along features: ``.chunk``, ``.split``,
    slicing, ``torch.chunk(...)``; empty when it does not (or the source cannot be read)."""
    tree = forward_tree(cls)
    if tree is None:
        return ()
    held = set()  # variables assigned the output directly
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _is_self_call(node.value, attr):
            held |= {t.id for t in node.targets if isinstance(t, ast.Name)}

    def is_output(node):
        return _is_self_call(node, attr) or (isinstance(node, ast.Name) and node.id in held)

    cuts = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SPLITTERS and is_output(node.value):
            cuts.append(f".{node.attr}(...)")
        elif isinstance(node, ast.Subscript) and is_output(node.value):
            cuts.append("slicing [...]")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SPLITTERS
              and node.args and is_output(node.args[0])):
            cuts.append(f"{node.func.attr}(...)")
    return tuple(sorted(set(cuts)))


@functools.cache
def config_reads(cls: type) -> tuple[str, ...]:
    """The attributes ``cls.forward`` reads as ``self.config.<attr>``."""
    return tuple(sorted(r[len("config."):] for r in self_reads(cls) or () if r.startswith("config.")))


@functools.cache
def self_reads(cls: type) -> tuple[str, ...] | None:
    """Everything ``cls.forward`` reads from ``self``: ``"<attr>"`` for ``self.<attr>`` (methods and
    submodules included) and ``"config.<attr>"`` for ``self.config.<attr>``; None when the source cannot
    be read."""
    tree = forward_tree(cls)
    if tree is None:
        return None
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        if _is_self(node.value):
            found.add(node.attr)
        elif isinstance(node.value, ast.Attribute) and node.value.attr == "config" and _is_self(node.value.value):
            found.add(f"config.{node.attr}")
    return tuple(sorted(found))


def _plain(node: ast.AST) -> bool:
    """A name, a constant, or an entry of a name (``masks[layer_type]``): a value computed elsewhere."""
    return isinstance(node, (ast.Name, ast.Constant)) or (isinstance(node, ast.Subscript)
                                                          and isinstance(node.value, ast.Name))


@functools.cache
def layer_calls(cls: type, attrs: tuple[str, ...] = ("layers", "h")) -> tuple[tuple[tuple[str, ...], ...], ...] | None:
    """How ``cls.forward`` calls the layers it loops over (``for layer in self.layers[...]`` or
    ``enumerate(self.h)``): per call, the names each argument is built from, positional ones first, then
    ``"<keyword>="`` per keyword whose value is a name, a constant or an entry of a name (a mask per layer
    type), ``"<keyword>=<expression>"`` for any other value, and ``"**"`` for a ``**kwargs`` unpack. None
    when the source cannot be read; empty when it has no such loop."""
    tree = forward_tree(cls)
    if tree is None:
        return None

    def over_layers(node):
        return any(isinstance(n, ast.Attribute) and n.attr in attrs and _is_self(n.value) for n in ast.walk(node))

    calls = []
    for loop in ast.walk(tree):
        if not (isinstance(loop, ast.For) and over_layers(loop.iter)):
            continue
        targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        for node in ast.walk(loop):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in targets:
                args = [tuple(sorted({n.id for n in ast.walk(a) if isinstance(n, ast.Name)})) for a in node.args]
                args += [(f"{k.arg}=" + ("" if _plain(k.value) else ast.unparse(k.value)),) if k.arg else ("**",)
                         for k in node.keywords]
                calls.append(tuple(args))
    return tuple(calls)
