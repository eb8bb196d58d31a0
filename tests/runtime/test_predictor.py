"""runtime.predictor: the ONNX Runtime predictor (contract, resizing, validation of model files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_prep.spec import CLASS_NAMES
from runtime.contract import ModelError
from runtime.predictor import Prediction, Predictor
from runtime.registry import list_models
from tests.conftest import REPO


@pytest.fixture(scope="module")
def predictor(score_model) -> Predictor:
    return Predictor(score_model, threads=1)


def _chips(n: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    pre = rng.integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    post = pre.copy()
    post[:, size // 4 : size // 2] = rng.integers(0, 256, (n, size // 2 - size // 4, size, 3))
    return pre, post


def _metadata(path: Path) -> dict:
    import onnx

    return {p.key: json.loads(p.value) for p in onnx.load(str(path)).metadata_props}


def test_attributes_come_from_the_metadata(predictor, score_model):
    md = _metadata(score_model)
    assert predictor.class_names == tuple(CLASS_NAMES) == tuple(md["class_names"])
    assert predictor.input_size == md["input_size"]
    assert predictor.spec.to_dict() == md["chip_spec"]
    assert predictor.embedding_dim == md["embedding_dim"]
    assert predictor.metadata["config"] == md["config"]
    assert predictor.providers == ["CPUExecutionProvider"]


def test_predict_matches_the_graph_and_probabilities_sum_to_one(predictor, score_model):
    import onnxruntime as ort

    s = predictor.input_size
    pre, post = _chips(7, s, seed=1)
    got = predictor.predict(pre, post, batch_size=3)
    assert isinstance(got, Prediction)
    k, d = len(CLASS_NAMES), predictor.embedding_dim
    assert got.logits.shape == (7, k) and got.probabilities.shape == (7, k)
    assert got.embedding.shape == (7, d)
    assert got.logits.dtype == got.probabilities.dtype == np.float32
    np.testing.assert_allclose(got.probabilities.sum(axis=1), 1.0, atol=1e-6)
    assert (got.probabilities > 0).all()
    # the same as one direct call of the graph (batching changes nothing)
    session = ort.InferenceSession(str(score_model), providers=["CPUExecutionProvider"])
    logits, emb = session.run(None, {"pre": pre, "post": post})
    np.testing.assert_allclose(got.logits, logits, atol=1e-5)
    np.testing.assert_allclose(got.embedding, emb, atol=1e-5)
    e = np.exp(logits - logits.max(1, keepdims=True))
    np.testing.assert_allclose(got.probabilities, e / e.sum(1, keepdims=True), atol=1e-6)


@pytest.mark.parametrize("tta", ["flips", "d8"])
def test_test_time_augmentation_averages_the_views(predictor, score_model, tta):
    """Each view is the same turn and mirror of pre and post through the graph; the logits are
    their mean and the embedding their renormalised mean; the plain view's change map is kept."""
    import onnxruntime as ort

    s = predictor.input_size
    pre, post = _chips(5, s, seed=4)
    got = Predictor(score_model, threads=1, tta=tta).predict(pre, post, batch_size=2)
    session = ort.InferenceSession(str(score_model), providers=["CPUExecutionProvider"])
    turns = [(0, False), (2, False), (0, True), (2, True)] if tta == "flips" else None
    turns = turns or [(k, m) for m in (False, True) for k in range(4)]
    logits, embs = [], []
    for k, mirrored in turns:
        views = []
        for chips in (pre, post):
            v = np.rot90(chips, k, axes=(1, 2))
            views.append(np.ascontiguousarray(v[:, :, ::-1] if mirrored else v))
        lo, emb = session.run(None, {"pre": views[0], "post": views[1]})[:2]
        logits.append(lo)
        embs.append(emb)
    np.testing.assert_allclose(got.logits, np.mean(logits, axis=0), atol=1e-5)
    mean = np.sum(embs, axis=0)
    np.testing.assert_allclose(
        got.embedding, mean / np.linalg.norm(mean, axis=1, keepdims=True), atol=1e-5
    )
    # the views differ (a model that ignored them would make this test pass trivially)
    assert np.abs(logits[1] - logits[0]).max() > 1e-4
    plain = predictor.predict(pre, post)
    assert np.abs(got.logits - plain.logits).max() > 1e-4
    with pytest.raises(ValueError, match="unknown test-time augmentation 'd4'"):
        Predictor(score_model, tta="d4")


def test_chips_at_another_size_are_resized(predictor):
    from data_prep.windows import resize_chip

    s = predictor.input_size
    big_pre, big_post = _chips(4, 2 * s + 6, seed=2)
    got = predictor.predict(big_pre, big_post)

    def resample(a):  # the resampler training uses
        return np.stack([resize_chip(c, s) for c in a])

    want = predictor.predict(resample(big_pre), resample(big_post))
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)
    assert not np.allclose(got.logits, predictor.predict(*_chips(4, s, seed=9)).logits)

    # enlarging a flat chip keeps it flat: same result as the flat chip at the input size
    colours = np.array([[30, 60, 90], [200, 10, 120]], np.uint8)
    small = np.broadcast_to(colours[:, None, None, :], (2, s // 2, s // 2, 3)).copy()
    full = np.broadcast_to(colours[:, None, None, :], (2, s, s, 3)).copy()
    got = predictor.predict(small, small[::-1].copy())
    want = predictor.predict(full, full[::-1].copy())
    np.testing.assert_allclose(got.logits, want.logits, atol=1e-5)


def test_empty_batch_and_bad_arrays(predictor):
    s = predictor.input_size
    empty = np.zeros((0, s, s, 3), np.uint8)
    got = predictor.predict(empty, empty)
    assert got.logits.shape == (0, len(CLASS_NAMES)) == got.probabilities.shape
    assert got.embedding.shape == (0, predictor.embedding_dim)
    pre, post = _chips(2, s, seed=3)
    with pytest.raises(ValueError, match="uint8"):
        predictor.predict(pre.astype(np.float32), post)
    with pytest.raises(ValueError, match="differ in shape"):
        predictor.predict(pre, post[:1])
    with pytest.raises(ValueError, match=r"\[N, H, W, 3\]"):
        predictor.predict(pre[0], post[0])


def test_card_shows_what_the_picker_needs(predictor, score_model):
    md = _metadata(score_model)
    card = predictor.card()
    assert card["name"] == score_model.stem and card["path"] == str(score_model)
    assert card["classes"] == list(CLASS_NAMES)
    assert card["input_size"] == md["input_size"] and card["chip_spec"] == md["chip_spec"]
    assert card["training_data"] == md["training_data"]
    assert card["validation_metrics"] == md["validation_metrics"]
    assert card["license"] == md["license"]
    assert card["parity"] == md["parity"] and card["precision"] == "fp32"
    assert card["encoder"] == md["config"]["model"]["encoder"]
    json.dumps(card)  # plain data, ready for the web app


def _tiny_onnx(path: Path, names=("pre", "post"), elem=None, props: dict | None = None) -> Path:
    """A two-input ONNX model with the right output names but arbitrary inputs and metadata."""
    import onnx
    from onnx import TensorProto, helper

    elem = TensorProto.UINT8 if elem is None else elem
    a, b = names
    nodes = [
        helper.make_node("Cast", [a], ["fa"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["fa"], ["logits"], keepdims=0),
        helper.make_node("Cast", [b], ["fb"], to=TensorProto.FLOAT),
        helper.make_node("ReduceMean", ["fb"], ["embedding"], keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "not-local-damage",
        [
            helper.make_tensor_value_info(a, elem, ["N", 8, 8, 3]),
            helper.make_tensor_value_info(b, elem, ["N", 8, 8, 3]),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("embedding", TensorProto.FLOAT, None),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for key, value in (props or {}).items():
        model.metadata_props.add(key=key, value=json.dumps(value))
    onnx.save(model, str(path))
    return path


GOOD_PROPS = {
    "format_version": 1,
    "class_names": list(CLASS_NAMES),
    "chip_spec": {"chip_size": 64, "context": 2.0, "min_size": 32},
    "input_size": 8,
}


def test_bad_model_files_raise_model_error_naming_the_file(tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n")
    with pytest.raises(ModelError, match="not a loadable ONNX model") as info:
        Predictor(text)
    assert str(text) in str(info.value)

    missing = tmp_path / "absent.onnx"
    with pytest.raises(ModelError, match="not found") as info:
        Predictor(missing)
    assert str(missing) in str(info.value)

    bare = _tiny_onnx(tmp_path / "bare.onnx")
    with pytest.raises(ModelError, match="missing metadata key") as info:
        Predictor(bare)
    assert str(bare) in str(info.value) and "class_names" in str(info.value)

    renamed = _tiny_onnx(tmp_path / "renamed.onnx", names=("before", "after"), props=GOOD_PROPS)
    with pytest.raises(ModelError, match="inputs are") as info:
        Predictor(renamed)
    assert str(renamed) in str(info.value)

    import onnx

    floats = _tiny_onnx(tmp_path / "float.onnx", elem=onnx.TensorProto.FLOAT, props=GOOD_PROPS)
    with pytest.raises(ModelError, match=r"tensor\(uint8\)"):
        Predictor(floats)

    newer = _tiny_onnx(tmp_path / "newer.onnx", props={**GOOD_PROPS, "format_version": 99})
    with pytest.raises(ModelError, match="format version"):
        Predictor(newer)

    # the same tiny graph with valid metadata loads: the checks above are what failed
    ok = Predictor(_tiny_onnx(tmp_path / "ok.onnx", props=GOOD_PROPS))
    assert ok.input_size == 8 and ok.spec.chip_size == 64
    assert issubclass(ModelError, ValueError)


def test_list_models(tmp_path):
    assert list_models(tmp_path / "nowhere") == []
    for name in ("b.onnx", "a.onnx", "notes.txt", "a.parity.json"):
        (tmp_path / name).write_text("x")
    (tmp_path / "sub.onnx").mkdir()
    assert list_models(tmp_path) == [tmp_path / "a.onnx", tmp_path / "b.onnx"]


def test_predictor_runs_without_torch(score_model):
    code = (
        "import sys, numpy as np\n"
        "from runtime.predictor import Predictor\n"
        f"p = Predictor({str(score_model)!r}, threads=1)\n"
        "x = np.zeros((2, 40, 40, 3), np.uint8)\n"
        "print(p.predict(x, x).probabilities.shape)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"(2, {len(CLASS_NAMES)})"
