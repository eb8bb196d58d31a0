"""runtime.exchange: pairs graded exchanged from the encoder output kept while grading them.

The order check grades a sample of each scene again with pre and post exchanged. Those grades
come from the encoder output kept while the buildings were graded, run through the graph's
head alone; they must be the grades of the whole graph run on the exchanged chips, bit for bit,
on an int8 and an fp32 model exported by the real pipeline. A network that matches the post chip
to the pre chip before its encoder (the bundled model's) has no such shortcut.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.exchange import Cut, find_cut, head_model, with_outputs
from runtime.predictor import Predictor
from runtime.registry import default_model


def _chips(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Smooth random pre chips and post chips with part of each replaced (damage-like)."""
    import cv2

    rng = np.random.default_rng(seed)
    pre = np.stack(
        [
            cv2.resize(
                rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8),
                (size, size),
                interpolation=cv2.INTER_CUBIC,
            )
            for _ in range(n)
        ]
    )
    post = pre.copy()
    half = size // 2
    post[: n // 2, :half] = rng.integers(0, 256, (n // 2, half, size, 3), dtype=np.uint8)
    return pre, post


@pytest.fixture(scope="module")
def int8_model(score_model, tmp_path_factory):
    """The tiny model's run exported static int8 (QDQ), as the bundled models are."""
    from local_damage.export.model import export_run
    from local_damage.export.options import ExportOptions

    out = tmp_path_factory.mktemp("int8") / "tiny.int8.onnx"
    export_run(score_model.parent / "run", out, ExportOptions(quantize="int8"))
    return out


@pytest.fixture(scope="module", params=["int8", "fp32"])
def model(request, score_model, int8_model):
    return int8_model if request.param == "int8" else score_model


def _same(a, b) -> None:
    for name in ("logits", "probabilities", "embedding", "raw_logits"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_grading_with_sides_changes_nothing(model):
    """Asked for the sides, the predictor returns the same grades, bit for bit."""
    predictor = Predictor(model, threads=1)
    size = predictor.input_size
    pre, post = _chips(37, size, 0)
    plain = predictor.predict(pre, post, batch_size=16)
    assert plain.sides is None
    with_sides = predictor.predict(pre, post, batch_size=16, sides=True)
    assert predictor.can_exchange
    _same(plain, with_sides)
    assert with_sides.sides.shape[:2] == (37, 2) and with_sides.sides.dtype == np.float32
    again = predictor.predict(pre, post, batch_size=16)  # the session with the cut as output
    _same(plain, again)


@pytest.mark.parametrize("rows", [[0], [3, 7, 11, 20, 25], list(range(32))])
def test_exchanged_from_sides_is_the_graph_on_exchanged_chips(model, rows):
    """Any subset of a graded batch, graded exchanged from its sides: the whole graph's grades
    of the chips given the other way round (logits, probabilities, embedding), bit for bit."""
    predictor = Predictor(model, threads=1)
    pre, post = _chips(32, predictor.input_size, 1)
    graded = predictor.predict(pre, post, batch_size=32, sides=True)
    rows = np.asarray(rows)
    got = predictor.exchanged(graded.sides[rows])
    want = predictor.predict(post[rows], pre[rows], batch_size=32)
    _same(got, want)
    # the exchanged order is not the given one: the test would see a head fed the wrong way
    if len(rows) > 4:
        assert not np.array_equal(got.raw_logits, graded.raw_logits[rows])


def test_sides_are_kept_only_where_the_graph_allows(int8_model):
    """Test-time augmentation averages views the sides do not hold: no sides, no shortcut."""
    predictor = Predictor(int8_model, threads=1, tta="flips")
    pre, post = _chips(4, predictor.input_size, 2)
    assert predictor.predict(pre, post, sides=True).sides is None
    assert not predictor.can_exchange
    with pytest.raises(ValueError, match="cannot grade pairs exchanged"):
        predictor.exchanged(np.zeros((1, 2, 4), np.float32))


def _toy(slice_axis: int = 0):
    """A tiny Siamese graph as the exporter traces one: pre and post concatenated on the batch
    axis, a shared layer, the result sliced at the batch size into the pre and post halves,
    a head reading both."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 6)).astype(np.float32), "w")
    v = numpy_helper.from_array(rng.standard_normal((12, 3)).astype(np.float32), "v")
    zero = numpy_helper.from_array(np.array([0], np.int64), "zero")
    big = numpy_helper.from_array(np.array([1 << 40], np.int64), "big")
    axis = numpy_helper.from_array(np.array([slice_axis], np.int64), "axis")
    nodes = [
        helper.make_node("Shape", ["pre"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero_scalar"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "zero"], ["n1"]),
        helper.make_node("Concat", ["pre", "post"], ["both"], axis=0),
        helper.make_node("MatMul", ["both", "w"], ["enc"]),
        helper.make_node("Relu", ["enc"], ["feat"]),
        helper.make_node("Slice", ["feat", "zero", "n1", "axis"], ["f_pre"]),
        helper.make_node("Slice", ["feat", "n1", "big", "axis"], ["f_post"]),
        helper.make_node("Concat", ["f_pre", "f_post"], ["joint"], axis=1),
        helper.make_node("MatMul", ["joint", "v"], ["logits"]),
        helper.make_node("Sub", ["f_pre", "f_post"], ["embedding"]),
    ]
    scalar = numpy_helper.from_array(np.array(0, np.int64), "zero_scalar")
    graph = helper.make_graph(
        nodes,
        "toy",
        [
            helper.make_tensor_value_info("pre", TensorProto.FLOAT, ["n", 4]),
            helper.make_tensor_value_info("post", TensorProto.FLOAT, ["n", 4]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", 3]),
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["n", 6]),
        ],
        [w, v, zero, big, axis, scalar],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # one every onnxruntime reads
    return model


def _session(proto):
    import onnxruntime as ort

    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def test_cut_of_a_traced_siamese_graph():
    """The cut is the shared map both slices read, bounded by the computed batch size; the
    head graded on the swapped map gives the whole graph's output on the swapped inputs."""
    proto = _toy()
    cut = find_cut(proto)
    assert cut == Cut("feat", ("n1",))
    rng = np.random.default_rng(1)
    pre, post = (rng.standard_normal((5, 4)).astype(np.float32) for _ in range(2))
    whole = _session(with_outputs(proto, cut))
    lo, z, feat, n1 = whole.run(["logits", "embedding", "feat", "n1"], {"pre": pre, "post": post})
    assert n1.tolist() == [5] and feat.shape == (10, 6)
    head = _session(head_model(proto, cut))
    swapped = np.concatenate([feat[5:], feat[:5]])
    got = head.run(["logits", "embedding"], {"feat": swapped, "n1": n1})
    want = _session(proto).run(["logits", "embedding"], {"pre": post, "post": pre})
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert not np.array_equal(got[0], lo)


def test_no_cut_where_the_post_chip_is_matched_to_the_pre_chip_before_the_encoder():
    """With the post rows normalised by the pre chip's statistics (model.pair_norm), exchanging
    the pair changes what the encoder sees: no cut, in a toy graph and in the bundled model,
    whose sides are then never kept and whose order check grades through the whole graph."""
    import onnx
    from onnx import helper

    proto = _toy()
    nodes = list(proto.graph.node)
    at = next(i for i, n in enumerate(nodes) if n.op_type == "Concat")
    matched = [
        helper.make_node("ReduceMean", ["pre"], ["pre_mean"], axes=[1], keepdims=1),
        helper.make_node("Add", ["post", "pre_mean"], ["post_matched"]),
    ]
    nodes[at].input[1] = "post_matched"
    del proto.graph.node[:]
    proto.graph.node.extend(nodes[:at] + matched + nodes[at:])
    assert find_cut(_toy()) is not None and find_cut(proto) is None
    _session(proto)  # still a valid graph

    bundled = Predictor(default_model(), threads=1)
    assert bundled.metadata["config"]["model"]["pair_norm"] is True
    assert find_cut(onnx.load(str(default_model()))) is None and not bundled.can_exchange
    pre, post = _chips(12, bundled.input_size, 4)
    assert bundled.predict(pre, post, sides=True).sides is None

    from app.scoring.order import OrderSample, grade_order

    sample = OrderSample()
    for row in range(12):
        sample.offer(row, pre[row], post[row])
    result = grade_order(bundled, sample, np.zeros(12, int))
    assert result.exchanged >= 8  # graded through the network, a step of 8 at a time
    rows = sample.rows[: result.exchanged]
    swapped = bundled.predict(post[rows], pre[rows]).probabilities.argmax(1)
    assert result.damaged_exchanged == pytest.approx(float(np.mean(swapped != 0)))


def test_no_cut_where_the_graph_is_not_split_on_the_batch():
    """Slices along another axis, or a head that reads an input directly, are no cut."""
    assert find_cut(_toy(slice_axis=1)) is None
    proto = _toy()
    for node in proto.graph.node:
        if node.op_type == "Sub":
            node.input[1] = "pre"  # the embedding reads an input past the cut
    assert find_cut(proto) is None


def test_order_check_grades_the_same_from_sides(synthetic_scene, score_model, int8_model):
    """grade_order on a sample with sides gives what it gives through the whole network, with
    none of the network's encoder runs; a model that cannot is graded through the network."""
    from app.scoring.order import OrderSample, grade_order

    class ChipsOnly:
        """The same predictor, seen without its shortcut (it has only ``predict``)."""

        def __init__(self, predictor):
            self.predictor, self.calls = predictor, 0

        def predict(self, pre, post, batch_size=32):
            self.calls += 1
            return self.predictor.predict(pre, post, batch_size)

    for model in (int8_model, score_model):
        predictor = Predictor(model, threads=1)
        pre, post = _chips(40, predictor.input_size, 3)
        graded = predictor.predict(pre, post, sides=True)
        sample = OrderSample()
        for row in range(40):
            sample.offer(row, pre[row], post[row])
        sample.keep_sides(range(40), graded.sides)
        assert sample.has_sides
        given = np.zeros(40, int)  # nothing damaged as given: the check grades at least 21
        fast = grade_order(predictor, sample, given)
        slow_model = ChipsOnly(predictor)
        slow = grade_order(slow_model, sample, given)
        assert fast == slow and fast.exchanged >= 21 and slow_model.calls >= 3


def test_sample_keeps_sides_of_its_rows_only():
    from app.scoring.order import OrderSample

    sample = OrderSample(size=4)
    chip = np.zeros((4, 4, 3), np.uint8)
    for row in range(4):
        sample.offer(row, chip, chip)
    sides = np.arange(6 * 2 * 3, dtype=np.float32).reshape(6, 2, 3)
    assert sample.wanted([2, 9, 0]) == [0, 2]
    sample.keep_sides([2, 9, 0], sides[:3])
    assert not sample.has_sides  # rows 1 and 3 have none yet
    sample.keep_sides([1, 3], sides[3:5])
    assert sample.has_sides
    assert np.array_equal(sample.sides[sample.rows.index(0)], sides[2])
    for row in range(4, 200):  # replaced rows lose their sides until graded again
        sample.offer(row, chip, chip)
    assert any(row >= 4 for row in sample.rows) and not sample.has_sides
    for row, side in zip(sample.rows, sample.sides, strict=True):
        assert (side is None) == (row >= 4)


def test_sides_too_large_are_not_kept(monkeypatch, int8_model):
    """A feature map over the limit is not kept: no sides, and the model grades exchanged pairs
    through the network from then on."""
    import runtime.predictor as predictor_module

    predictor = Predictor(int8_model, threads=1)
    pre, post = _chips(4, predictor.input_size, 4)
    kept = predictor.predict(pre, post, sides=True).sides
    assert kept is not None and kept[0].nbytes <= predictor_module.MAX_SIDES_BYTES
    monkeypatch.setattr(predictor_module, "MAX_SIDES_BYTES", kept[0].nbytes - 4)
    fresh = Predictor(int8_model, threads=1)
    assert fresh.predict(pre, post, sides=True).sides is None
    assert not fresh.can_exchange
    _same(fresh.predict(pre, post), predictor.predict(pre, post))
