"""Grading a pair exchanged (post as pre, pre as post) from what grading it as given computed.

A damage model runs pre and post through one encoder as a batch of ``2N`` (the ``N`` pre chips,
then the ``N`` post chips) and slices that batch's last feature map in two: rows ``[0, N)`` feed
the pre side of the heads, rows ``[N, 2N)`` the post side. Everything ``logits`` and
``embedding`` depend on after that is the *head* of the graph. Grading a pair exchanged runs the
encoder on the same two chips again; only their order in the batch differs. So the encoder's
last feature map of each chip, kept from the grading as given, graded by the head with the two
halves of the batch swapped gives the exchanged grading bit for bit (the encoder treats each row
of a batch on its own; the head's quantisation scales are those of each side, as in the whole
graph), at the cost of the head alone. This holds only where each chip reaches the encoder on
its own: a network that matches the post chip to the pre chip before the encoder
(``model.pair_norm``, the bundled model's) feeds it other post rows once the pair is exchanged,
and has no cut.

:func:`find_cut` finds that map in a model file (None when the graph is not built so: the
caller grades the chips exchanged through the whole graph); :func:`with_outputs` adds it to the
graph's outputs; :func:`head_model` is the head as a model of its own. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from runtime.contract import OUTPUT_NAMES


@dataclass(frozen=True)
class Cut:
    """Where a graph splits into encoder and head.

    Attributes:
        features: the encoder's last feature map, ``[2N, ...]`` float (pre rows, then post rows).
        bounds: the computed tensors the two slices take their bounds from (the batch size
            ``N`` as a one-element int64 tensor, in graphs traced from the model).
    """

    features: str
    bounds: tuple[str, ...]

    @property
    def names(self) -> list[str]:
        """The cut's tensors: the feature map, then the bounds."""
        return [self.features, *self.bounds]

    def value_info(self, name: str):
        """The ONNX value info of one of the cut's tensors (float map, int64 bounds)."""
        from onnx import TensorProto, helper

        elem = TensorProto.FLOAT if name == self.features else TensorProto.INT64
        return helper.make_tensor_value_info(name, elem, None)


def _upstream(producer: dict, start, skip=frozenset(), stop=lambda node: False):
    """``(tensor, producing node or None)`` of every tensor ``start`` depends on, each once,
    walking back through producers; tensors in ``skip`` are left out, and the walk does not go
    past a node for which ``stop`` is true (it is still yielded)."""
    stack, seen = list(start), set()
    while stack:
        name = stack.pop()
        if not name or name in seen or name in skip:
            continue
        seen.add(name)
        node = producer.get(name)
        yield name, node
        if node is not None and not stop(node):
            stack.extend(node.input)


def _producers(graph) -> dict:
    return {out: node for node in graph.node for out in node.output}


def _ancestry(graph, outputs):
    """``(nodes, slices)``: the nodes ``outputs`` depend on, stopping at Slice nodes (which
    are kept apart), in the graph's order."""
    constants = {init.name for init in graph.initializer}
    # the node objects are told apart by id(): the producer map keeps them alive meanwhile
    producer = _producers(graph)
    walk = _upstream(producer, outputs, constants, lambda n: n.op_type == "Slice")
    wanted: set[int] = set()
    slices: list = []
    for _, node in walk:
        if node is None:
            continue
        if node.op_type == "Slice":  # reached once: through its one output
            slices.append(node)
        else:
            wanted.add(id(node))
    return [n for n in graph.node if id(n) in wanted], slices


def _constants(graph) -> dict:
    """Every constant tensor of a graph by name: the initializers and the Constant nodes'
    outputs (their TensorProto, None for a Constant given otherwise than as a tensor)."""
    out: dict = {init.name: init for init in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            out[node.output[0]] = next((a.t for a in node.attribute if a.name == "value"), None)
    return out


def _rows_independent(graph, features: str) -> bool:
    """Whether each half of the encoder's batch comes from one graph input alone: the batch is
    a Concat of two tensors, the first depending on one input only and the second on the
    other only. A network that normalises the post chip by the pre chip's statistics before the
    encoder (``model.pair_norm``) is not: its post rows change when pre and post are exchanged,
    so the encoder must run again."""
    producer, constants = _producers(graph), set(_constants(graph))
    inputs = {i.name for i in graph.input}

    def sources(name: str) -> set[str]:
        return {t for t, _ in _upstream(producer, [name]) if t in inputs}

    # back from the feature map to the Concat that assembled the batch
    is_concat = lambda node: node.op_type == "Concat"  # noqa: E731
    for _, node in _upstream(producer, [features], constants, is_concat):
        if node is not None and is_concat(node):
            parts = [sources(i) for i in node.input if i and i not in constants]
            return len(parts) == 2 and all(len(p) == 1 for p in parts) and parts[0] != parts[1]
    return False


def find_cut(proto) -> Cut | None:
    """The cut between encoder and head of a damage model (module docstring), or None.

    The head is what ``logits`` and ``embedding`` depend on after the Slice nodes that split the
    encoder's batch; the cut is found only where exactly two Slice nodes read one tensor, cut
    along the batch axis, the head depends on no graph input but through them, and each half of
    the encoder's batch comes from one graph input alone (:func:`_rows_independent`).
    """
    graph = proto.graph
    nodes, slices = _ancestry(graph, OUTPUT_NAMES)
    if len(slices) != 2 or slices[0].input[0] != slices[1].input[0]:
        return None
    values = _constants(graph)
    constant = set(values)
    from onnx import numpy_helper

    for s in slices:  # along the batch axis (axes [0] or none given), step 1 or none given
        for k, expected in ((3, [0]), (4, [1])):
            name = s.input[k] if len(s.input) > k else ""
            if name and (
                values.get(name) is None
                or numpy_helper.to_array(values[name]).ravel().tolist() != expected
            ):
                return None
    if not _rows_independent(graph, slices[0].input[0]):
        return None
    bounds = tuple(sorted({i for s in slices for i in s.input[1:3] if i and i not in constant}))
    cut = Cut(slices[0].input[0], bounds)
    # the head may read nothing before the cut but constants
    produced = {out for node in nodes for out in node.output} | {
        out for s in slices for out in s.output
    }
    allowed = produced | constant | set(cut.names)
    for node in nodes:
        if any(i and i not in allowed for i in node.input):
            return None
    return cut


def with_outputs(proto, cut: Cut):
    """A copy of ``proto`` that also outputs the cut's tensors (the graph is otherwise the
    same: its own outputs come out bit for bit as before)."""
    from onnx import ModelProto

    out = ModelProto()
    out.CopyFrom(proto)
    have = {o.name for o in out.graph.output}
    out.graph.output.extend(cut.value_info(name) for name in cut.names if name not in have)
    return out


def head_model(proto, cut: Cut):
    """The head alone: a model whose inputs are the cut's tensors and whose outputs are
    ``logits`` and ``embedding``."""
    from onnx import helper

    graph = proto.graph
    nodes, slices = _ancestry(graph, OUTPUT_NAMES)
    keep = {id(n) for n in nodes} | {id(s) for s in slices}
    # the bounds' own producers and the Constant nodes the head reads stay out of / in the head
    bound_set = set(cut.bounds)
    body = [
        n
        for n in graph.node
        if (id(n) in keep or n.op_type == "Constant") and not (set(n.output) & bound_set)
    ]
    used = {i for n in body for i in n.input if i}
    body = [n for n in body if n.op_type != "Constant" or set(n.output) & used]
    inits = [init for init in graph.initializer if init.name in used]
    inputs = [cut.value_info(name) for name in cut.names]
    outputs = [o for o in graph.output if o.name in OUTPUT_NAMES]
    head = helper.make_graph(body, "head", inputs, outputs, inits)
    model = helper.make_model(head, opset_imports=list(proto.opset_import))
    model.ir_version = proto.ir_version
    return model
