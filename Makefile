# One-command entry points for a fresh machine (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXAMPLE := work/example
PORT ?= 7860
# Real xBD tiles for the default model (CC BY-NC-SA 4.0; see models/default.md).
XBD ?= ../shared/data/xbd_sample
DEFAULT := work/default-model
LOCALIZER := work/localizer
# Held-out test tiles of the default model: fold 1 of `split --folds 5 --seed 14` (7 of 33
# tiles, every event of the sample).
HOLDOUT_SEED := 14
HOLDOUT_FOLD := 1
# Calibration fold: the default model never trains on it; its temperature and the threshold of
# the ood flag are fitted there (docs/calibration.md, docs/flags.md).
CALIB_FOLD := 3
# The shipped method (configs/default.yaml) and the one it is compared with on the held-out tiles;
# LOCAL_SETS turns the default recipe into LOCAL with the fixes of docs/method.md.
SHIPPED := $(shell sed -n 's/^  method: *//p' configs/default.yaml)
LOCAL_SETS := --set loss.method=local --set loss.normalize_z=false --set model.latent_abs=true
SCL_SETS := --set loss.method=scl --set loss.normalize_z=true --set model.latent_abs=false
# Held-out figures stored in the default model's metadata (from `make default-model-heldout`).
TEST_METRICS ?= $(DEFAULT)/heldout-$(SHIPPED)/eval/metrics.json

.PHONY: install run demo test test-all lint format clean default-chips default-model \
	default-model-heldout localizer

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

## The main job: the web app with the bundled default model, on http://127.0.0.1:$(PORT).
run: install
	$(BIN)/local-damage app --port $(PORT)

## The same without a browser: score an example scene to GeoJSON, COG raster and PNG overlay.
demo: install
	$(BIN)/local-damage demo --out work/demo

## Training runs pin their PyTorch thread count: the same seed gives other weights with another
## thread count (sums in another order), so the published figures reproduce on any machine only
## with it fixed (the shipped model was trained on two threads, the held-out runs on one).

## Chips of the xBD sample and the tile folds that hold out the default model's test tiles.
default-chips: install
	$(BIN)/local-damage prepare xbd --xbd $(XBD) --out $(DEFAULT)/chips --workers 2
	$(BIN)/local-damage split $(DEFAULT)/chips --folds 5 --by tile --seed $(HOLDOUT_SEED)

## The default model, end to end: prepare, split, train on every tile but the calibration fold,
## export int8 ONNX calibrated on that fold (run `make default-model-heldout` first to store its
## held-out figures in the model).
default-model: default-chips
	OMP_NUM_THREADS=1 $(BIN)/local-damage train --config configs/default.yaml \
		--chips $(DEFAULT)/chips --fold $(CALIB_FOLD) --out $(DEFAULT)/run
	$(BIN)/local-damage export --run $(DEFAULT)/run --out models/default.onnx \
		--quantize int8 --change-map --weights models/default.safetensors \
		--calibrate-fold $(CALIB_FOLD) \
		$(if $(wildcard $(TEST_METRICS)),--test-metrics $(TEST_METRICS))

## The model card's figures: SCL and LOCAL (fixed) by the default recipe, trained without the
## held-out tiles and the calibration fold, exported and calibrated as the shipped model is, and
## evaluated on the held-out tiles.
default-model-heldout: default-chips
	for method in scl local; do \
		if [ $$method = local ]; then sets="$(LOCAL_SETS)"; else sets="$(SCL_SETS)"; fi; \
		OMP_NUM_THREADS=1 $(BIN)/local-damage train --config configs/default.yaml \
			--chips $(DEFAULT)/chips --holdout $(HOLDOUT_FOLD) --fold $(CALIB_FOLD) $$sets \
			--out $(DEFAULT)/heldout-$$method \
		&& $(BIN)/local-damage export --run $(DEFAULT)/heldout-$$method \
			--out $(DEFAULT)/heldout-$$method/model.onnx --quantize int8 --change-map \
			--calibrate-fold $(CALIB_FOLD) \
		&& $(BIN)/local-damage evaluate --model $(DEFAULT)/heldout-$$method/model.onnx \
			--chips $(DEFAULT)/chips --fold $(HOLDOUT_FOLD) --views 1 --no-tsne \
			--out $(DEFAULT)/heldout-$$method/eval || exit 1; \
	done

## The building localiser, models/localizer.onnx (docs/localize.md, models/localizer.md): its
## held-out figures first (trained without the test and calibration folds, threshold and smallest
## blob chosen on the calibration fold, exported int8 and scored on the test fold), then the shipped
## model, trained on every fold but the calibration fold and exported int8 with those figures.
## About 75 minutes on 2 CPU cores.
localizer: install
	$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --holdout $(HOLDOUT_FOLD) --fold $(CALIB_FOLD) \
		--out $(LOCALIZER)/heldout --quiet
	$(BIN)/local-damage localize export --run $(LOCALIZER)/heldout \
		--out $(LOCALIZER)/heldout/model.onnx --quantize int8
	$(BIN)/local-damage localize evaluate --model $(LOCALIZER)/heldout/model.onnx --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --fold $(HOLDOUT_FOLD) --out $(LOCALIZER)/heldout/test.json
	$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --fold $(CALIB_FOLD) --out $(LOCALIZER)/run --quiet
	$(BIN)/local-damage localize export --run $(LOCALIZER)/run --out models/localizer.onnx \
		--quantize int8 --test-metrics $(LOCALIZER)/heldout/test.json

## The test suite (fast tests plus real-data tests when ../shared/data is present).
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

## Everything, slow tests included.
test-all: install
	$(BIN)/python -m pytest -m ""

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) work .pytest_cache .ruff_cache .hypothesis
