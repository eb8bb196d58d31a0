# One-command entry points for a fresh machine (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXAMPLE := work/example
PORT ?= 7860
# Real xBD tiles (CC BY-NC-SA 4.0; see models/default.md): every labelled tile of both folders.
XBD ?= ../shared/data/xbd_sample
XBD_EXTRA ?= ../shared/data/xbd_extra
DEFAULT := work/default-model
LOCALIZER := work/localizer
# Hurricane Michael's 65 labelled tiles (../shared/data/xbd_michael/README.md), extracted from a
# local mirror of their public repository: `make michael MIRROR=/path/to/the/mirror/git/dir`.
MICHAEL ?= work/data/xbd_michael
MIRROR ?=
# Every labelled tile of the five events (both folders and Michael) in one store at 64 px (the
# recipes' input size), with its spatial-block folds (splits.csv) and a copy with one fold per
# event (ALL5_EVENTS); docs/experiments/generalisation.md.
ALL5 := work/all5/chips64
ALL5_EVENTS := work/all5/events64
# The default model (models/default.md): the general recipe trained for 40 epochs
# (configs/cpu-local-general-long.yaml) on every labelled tile of the five events, graded at
# false-alarm cost 5 (chosen on the recipe's folds: docs/experiments/generalisation/ship_choice.py).
# Its figures are the recipe's cross-validation by spatial block, run on a copy of the five-event
# store whose chips went through the packed form (JPEG quality 95) that the folds were first
# trained from (docs/experiments/generalisation.md); its temperature and ood threshold come from
# those folds (export --oof-predictions --oof-folds; OOF_FOLDS: the folds whose embeddings the
# shipped file's threshold is carried over from). Two training threads in bfloat16 autocast, as
# the folds had: the same seed trains other weights on another thread count or precision (on a
# CPU without native bfloat16, AVX-512 BF16 or AMX, it is emulated and slow).
LONG := configs/cpu-local-general-long.yaml
LONG_NAME := block-general-long
SHIP_COST := 5
BLOCK := work/cpu-gen/block
BLOCK_RUNS := work/cpu-gen/runs/$(LONG_NAME)
BLOCK_TABLE := work/cpu-gen/table-long
SHIP_RUN := work/ship/long
OOF_FOLDS := 0 1 2 3 4
TRAIN_SETS := --set train.device=cpu --set train.amp=bf16
# The four-event tile folds of the previous default model (commit 576f257) and its recipe: both
# folders, 5 folds by tile dealt event by event (docs/experiments/cv.md).
ALL_CHIPS := work/all/chips
CV_OUT := work/cv/methods
RECIPE := configs/cpu-local.yaml
# The previous default model was the recipe's run of fold 2 (trained on folds 0, 1, 3 and 4, its
# ood threshold fitted on fold 2 and its held-out figures measured there); the localiser keeps
# those folds.
DEFAULT_FOLD := 2
DEFAULT_RUN := $(CV_OUT)/$(basename $(notdir $(RECIPE)))/fold$(DEFAULT_FOLD)
# The localiser's run: the tile folds above, fold 2 held out, fold 3 its calibration fold.
LOC_CALIB_FOLD := 3
LOC_RUN := $(LOCALIZER)/all-f$(DEFAULT_FOLD)
# Where `make localizer-cv` trains: cpu (one thread a fold), or cuda on a machine with a GPU
# (`make localizer-cv LOC_DEVICE=cuda`: minutes a fold instead of hours; docs/localize.md#on-a-gpu).
LOC_DEVICE ?= cpu
# The previous studies' tiles: fold 1 of `split --folds 5 --seed 14` of the xBD sample (7 of 33
# tiles, every event) was their test fold, fold 3 their calibration fold.
HOLDOUT_SEED := 14
HOLDOUT_FOLD := 1
CALIB_FOLD := 3
# The study of the previous default recipe (configs/default.yaml; docs/experiments/results.md):
# LOCAL with the departures of docs/method.md against SCL on the xBD sample's fold 1.
LOCAL_SETS := --set loss.method=local --set loss.normalize_z=false --set model.latent_abs=true
SCL_SETS := --set loss.method=scl --set loss.normalize_z=true --set model.latent_abs=false

.PHONY: install run demo test test-fast test-all lint format clean all-chips default-chips default-model \
	default-model-cv four-event-model four-event-cv default-model-heldout localizer localizer-cv localizer-sample michael all5-chips

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
## with it fixed (every target here trains on one thread).

## Chips of every labelled tile of both xBD folders and their event-stratified tile folds.
all-chips: install
	$(BIN)/local-damage prepare xbd --xbd $(XBD) --xbd $(XBD_EXTRA) --out $(ALL_CHIPS) --workers 2
	$(BIN)/local-damage split $(ALL_CHIPS) --folds 5 --by tile --stratify event --seed $(HOLDOUT_SEED)

## Hurricane Michael's tiles into $(MICHAEL), from the mirror's git directory given as MIRROR.
michael:
	@[ -n "$(MIRROR)" ] || { echo "error: give MIRROR=GIT_DIR, a mirror of gvas213/Automated-Disaster-Assessment- (../shared/data/xbd_michael/README.md)" >&2; exit 2; }
	bash ../shared/tools/get_xbd_michael.sh $(MIRROR) $(MICHAEL)

## Chips of the five events (both folders and Michael) and their spatial-block and event folds.
all5-chips: install
	@[ -d $(MICHAEL)/labels ] || { echo "error: no $(MICHAEL)/labels; run make michael MIRROR=... first" >&2; exit 2; }
	$(BIN)/local-damage prepare xbd --xbd $(XBD) --xbd $(XBD_EXTRA) --xbd $(MICHAEL) \
		--out $(ALL5) --chip-size 64 --workers 2 --quiet
	rm -rf $(ALL5_EVENTS) && cp -r $(ALL5) $(ALL5_EVENTS)
	$(BIN)/local-damage split $(ALL5) --by block --folds 5 --stratify event --seed $(HOLDOUT_SEED)
	$(BIN)/local-damage split $(ALL5_EVENTS) --by event

## The default model's figures: its recipe cross-validated by spatial block over the five
## events (about 3.5 CPU-hours on 2 cores with AVX-512 BF16; finished folds are reused), each
## fold's figures on its own training buildings and its embeddings, and the table of the five
## folds in $(BLOCK_TABLE) (cv_table.md, oof_predictions.csv, oof_metrics.json).
default-model-cv: all5-chips
	$(BIN)/python -m data_prep.store_pack pack $(ALL5) work/cpu-gen/all5.pack
	rm -rf $(BLOCK) && $(BIN)/python -m data_prep.store_pack unpack work/cpu-gen/all5.pack $(BLOCK)
	$(BIN)/local-damage split $(BLOCK) --by block --folds 5 --stratify event --seed $(HOLDOUT_SEED)
	for fold in 0 1 2 3 4; do \
		[ -f $(BLOCK_RUNS)/fold$$fold/embeddings.npz ] && continue; \
		OMP_NUM_THREADS=2 $(BIN)/local-damage cv --config $(LONG) --chips $(BLOCK) \
			--out $(dir $(BLOCK_RUNS)) --name $(LONG_NAME) --folds $$fold --views 1 \
			$(TRAIN_SETS) --quiet || exit 1; \
		OMP_NUM_THREADS=2 $(BIN)/python -m local_damage.experiments.fold_extras \
			$(BLOCK_RUNS)/fold$$fold $(BLOCK) $$fold || exit 1; \
	done
	$(BIN)/python docs/experiments/generalisation/fold_table.py $(BLOCK) $(BLOCK_TABLE) \
		$(LONG_NAME) $(foreach f,0 1 2 3 4,$(BLOCK_RUNS)/fold$(f))

## The default model, end to end: its recipe trained on every labelled tile of the five events
## (about 55 minutes on 2 cores with AVX-512 BF16; a finished run is reused), exported int8 with the
## change map, the raw probabilities (the temperature fitted out of fold is recorded, not applied:
## models/default.md says why), its grade rule (false-alarm cost $(SHIP_COST)), the ood threshold
## and scene reference carried over from the folds, the recipe's cross-validated figures and the
## fp16 weights.
default-model: default-model-cv
	[ -f $(SHIP_RUN)/summary.json ] || OMP_NUM_THREADS=2 $(BIN)/local-damage train \
		--config $(LONG) --chips $(ALL5) --out $(SHIP_RUN) $(TRAIN_SETS) --quiet
	$(BIN)/local-damage export --run $(SHIP_RUN) --out models/default.onnx --quantize int8 \
		--change-map --oof-predictions $(BLOCK_TABLE)/oof_predictions.csv \
		--oof-folds $(foreach f,$(OOF_FOLDS),$(BLOCK_RUNS)/fold$(f)) --no-temperature \
		--false-alarm-cost $(SHIP_COST) --test-metrics $(BLOCK_TABLE)/oof_metrics.json \
		--weights models/default.safetensors --quiet

## The previous default model (commit 576f257; docs/experiments/cv.md): the four-event recipe's run
## of tile fold 2 (reused when present; about 65 minutes on one thread), exported int8 with the raw
## probabilities and the ood prototypes and threshold, scored on fold 2, and exported again with
## those held-out figures, to work/default-model/four-event.onnx (today's exporter keeps the int8
## front end in float, so a few grades may differ from the file of that commit).
four-event-model: all-chips
	OMP_NUM_THREADS=1 $(BIN)/local-damage cv --config $(RECIPE) --chips $(ALL_CHIPS) \
		--out $(CV_OUT) --folds $(DEFAULT_FOLD) --views 1 --quiet
	$(BIN)/local-damage export --run $(DEFAULT_RUN) --out $(DEFAULT)/model.onnx --quantize int8 \
		--change-map --calibrate-fold $(DEFAULT_FOLD) --no-temperature --quiet
	$(BIN)/local-damage evaluate --model $(DEFAULT)/model.onnx --chips $(ALL_CHIPS) \
		--fold $(DEFAULT_FOLD) --views 1 --no-tsne --out $(DEFAULT)/eval --quiet
	$(BIN)/local-damage export --run $(DEFAULT_RUN) --out $(DEFAULT)/four-event.onnx --quantize int8 \
		--change-map --calibrate-fold $(DEFAULT_FOLD) --no-temperature \
		--test-metrics $(DEFAULT)/eval/metrics.json --weights $(DEFAULT)/four-event.safetensors --quiet

## The four-event recipe cross-validated over its five tile folds (about 8 CPU-hours; finished
## folds are reused). The tables land in $(CV_OUT)/cv_table.md.
four-event-cv: all-chips
	OMP_NUM_THREADS=1 $(BIN)/local-damage cv --config $(RECIPE) --chips $(ALL_CHIPS) \
		--out $(CV_OUT) --views 1 --quiet

## Chips of the xBD sample alone and its tile folds (fold 1 test, fold 3 calibration): the
## previous default recipe's study and the localiser's tiles.
default-chips: install
	$(BIN)/local-damage prepare xbd --xbd $(XBD) --out $(DEFAULT)/chips --workers 2
	$(BIN)/local-damage split $(DEFAULT)/chips --folds 5 --by tile --seed $(HOLDOUT_SEED)

## The previous default recipe's held-out figures (docs/experiments/results.md): SCL and LOCAL by
## configs/default.yaml trained without the xBD sample's fold 1 and fold 3, exported and calibrated
## on fold 3, evaluated on fold 1.
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

## The building localiser, models/localizer.onnx (docs/localize.md, models/localizer.md), on the
## tiles of both folders with the default model's folds: trained on folds 0, 1 and 4, its epoch,
## threshold and smallest blob chosen on fold 3, never shown fold 2 (the default model's held-out
## fold), scored there, and exported int8 with those figures. About 60 minutes on one thread of a
## CPU with native bfloat16 (docs/localize.md: fp32 elsewhere, several hours).
localizer: all-chips
	$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
		--xbd $(XBD_EXTRA) --splits $(ALL_CHIPS)/splits.csv --holdout $(DEFAULT_FOLD) \
		--fold $(LOC_CALIB_FOLD) --set train.threads=1 --out $(LOC_RUN) --quiet
	$(BIN)/local-damage localize export --run $(LOC_RUN) --out $(LOC_RUN)/model.onnx --quantize int8
	$(BIN)/local-damage localize evaluate --model $(LOC_RUN)/model.onnx --xbd $(XBD) \
		--xbd $(XBD_EXTRA) --splits $(ALL_CHIPS)/splits.csv --fold $(DEFAULT_FOLD) \
		--out $(LOC_RUN)/test.json
	$(BIN)/local-damage localize export --run $(LOC_RUN) --out models/localizer.onnx \
		--quantize int8 --test-metrics $(LOC_RUN)/test.json

## The localiser's figures over all five folds: for each test fold K, trained without folds K and
## K+1 (mod 5), epoch, threshold and smallest blob chosen on fold K+1, scored on fold K (fold 2 is
## the shipped model's run). About an hour per fold on one thread of a CPU with native bfloat16
## (AVX-512 BF16 or AMX); about 6-7 hours in fp32 on an AVX2-only CPU; LOC_DEVICE=cuda trains on a
## GPU. Finished folds are kept.
localizer-cv: all-chips
	for k in 0 1 2 3 4; do \
		run=$(LOCALIZER)/all-f$$k; calib=$$(( (k + 1) % 5 )); \
		[ -f $$run/test.json ] && continue; \
		$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
			--xbd $(XBD_EXTRA) --splits $(ALL_CHIPS)/splits.csv --holdout $$k --fold $$calib \
			--set train.threads=1 --set train.device=$(LOC_DEVICE) --out $$run --quiet \
		&& $(BIN)/local-damage localize export --run $$run --out $$run/model.onnx --quantize int8 \
		&& $(BIN)/local-damage localize evaluate --model $$run/model.onnx --xbd $(XBD) \
			--xbd $(XBD_EXTRA) --splits $(ALL_CHIPS)/splits.csv --fold $$k \
			--out $$run/test.json || exit 1; \
	done

## The previous localiser's study (the xBD sample alone; docs/experiments/results.md): its
## held-out figures first (trained without the test and calibration folds, threshold and smallest
## blob chosen on the calibration fold, exported int8 and scored on the test fold), then the shipped
## model, trained on every fold but the calibration fold and exported int8 with those figures.
## About 75 minutes on 2 CPU cores.
localizer-sample: install
	$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --holdout $(HOLDOUT_FOLD) --fold $(CALIB_FOLD) \
		--out $(LOCALIZER)/heldout --quiet
	$(BIN)/local-damage localize export --run $(LOCALIZER)/heldout \
		--out $(LOCALIZER)/heldout/model.onnx --quantize int8
	$(BIN)/local-damage localize evaluate --model $(LOCALIZER)/heldout/model.onnx --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --fold $(HOLDOUT_FOLD) --out $(LOCALIZER)/heldout/test.json
	$(BIN)/local-damage localize train --config configs/localize.yaml --xbd $(XBD) \
		--split-seed $(HOLDOUT_SEED) --fold $(CALIB_FOLD) --out $(LOCALIZER)/run --quiet
	$(BIN)/local-damage localize export --run $(LOCALIZER)/run --out $(LOCALIZER)/run/model.onnx \
		--quantize int8 --test-metrics $(LOCALIZER)/heldout/test.json

## The whole test suite (real-data tests skip when ../shared/data is absent).
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

## The tests that neither train, start clusters, processes or browsers, nor read ../shared/data:
## a couple of minutes, for the edit-test loop.
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow and not browser and not realdata"

## The same as test (kept for scripts that call it).
test-all: test

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) work .pytest_cache .ruff_cache .hypothesis
