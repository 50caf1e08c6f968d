# k2trt — one venv at .venv; every target sets it up first if needed.
PY      := .venv/bin/python
K2TRT   := .venv/bin/k2trt
# the embedded tiny release: fp8 (Kimi-K2-Instruct, the default), int4 (Kimi-K2-Thinking), k2.5 (Kimi-K2.5's layout)
FORMAT  ?= fp8
SUFFIX  := $(if $(filter-out fp8,$(FORMAT)),-$(FORMAT))
# make generate EP=2 (and PIPELINE=2 EP=2): expert-parallel ranks, which need graphs exported for E
EP      ?=
TINY    ?= build/tiny$(SUFFIX)
ONNX    ?= build/onnx$(SUFFIX)$(if $(EP),-ep$(EP))
ENGINES ?= build/engines
# float32 graphs for ONNX Runtime on a CPU; bfloat16 for TensorRT engines (make export DTYPE=bfloat16 ONNX=build/onnx-bf16)
DTYPE   ?= float32
# The CPU build of torch 2.13.0; on a GPU machine use `make install EXTRAS=gpu,serve,dev TORCH=torch`.
# Where pip would otherwise pick a CUDA build, set TORCH_INDEX to PyTorch's CPU wheel index.
TORCH   ?= torch==2.13.0
TORCH_INDEX ?=
# serve: fastapi + uvicorn; bench: transformers, the second baseline of `make bench` (and its tests)
EXTRAS  ?= cpu,serve,dev,bench
# EXTRAS=gpu installs the TensorRT wheel built for this driver's CUDA: gpu-cu13 on a CUDA 13 driver, else gpu-cu12
# (a cu13 TensorRT does not load on a CUDA 12 driver). Name gpu-cu12 / gpu-cu13 to choose yourself.
comma   := ,
empty   :=
space   := $(empty) $(empty)
EXTRAS_FOR_DRIVER = $(subst $(space),$(comma),$(strip $(foreach e,$(subst $(comma), ,$(EXTRAS)),$(if $(filter gpu,$(e)),gpu-$(shell python3 k2trt/tools/driver_cuda.py),$(e)))))
# make generate PIPELINE=2: the same generation as pipeline stages, one process each
PIPELINE ?=
PIPE    := $(if $(PIPELINE),--pipeline $(PIPELINE)) $(if $(EP),--expert-parallel $(EP))

.PHONY: install test test-fast tiny export generate chat bench bench-stream bench-prefill serve bench-serve engines compare gpu-check doctor clean

install: .venv/.installed

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip setuptools
	$(PY) -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[$(EXTRAS_FOR_DRIVER)]"
	touch $@

# the whole suite (what CI runs), with its 20 slowest tests in sight; test-fast: the tests not marked slow, the
# loop to run while working. Both on a pytest-xdist worker per core this process may run on (at most 4; JOBS=N
# to choose), a test file per worker
# (tests/README.md says what is where); the suite passes without xdist too.
JOBS    ?= $(shell python3 -c "import os; print(min(4, len(os.sched_getaffinity(0))))")
XDIST   := -n $(JOBS) --dist loadfile
test: install
	$(PY) -m pytest $(XDIST) --durations=20

test-fast: install
	$(PY) -m pytest $(XDIST) -m "not slow" --durations=10

tiny: $(TINY)/config.json

$(TINY)/config.json: | install
	$(K2TRT) make-tiny $(TINY) --format $(FORMAT)

export: tiny
	$(K2TRT) export --model $(TINY) --out $(ONNX) --dtype $(DTYPE) $(if $(EP),--expert-parallel $(EP))

generate: export
	$(K2TRT) generate --model $(TINY) --onnx $(ONNX) --prompt "The quick brown fox" --max-new-tokens 32 $(PIPE)
	$(K2TRT) generate --model $(TINY) --onnx $(ONNX) --chat "Hello! Who are you?" --max-new-tokens 24 --temperature 0.8 --top-p 0.95 --seed 1 $(PIPE)

chat: export
	$(K2TRT) chat --model $(TINY) --onnx $(ONNX)

# e.g. make bench BENCH_ARGS="--repeat 5 --batch 1,4 --prompt-len 16"
bench: export
	$(K2TRT) bench --model $(TINY) --onnx $(ONNX) $(BENCH_ARGS)

bench-stream: install
	$(PY) -m k2trt.tools.stream_bench --gb 4

bench-prefill: export
	$(PY) -m k2trt.tools.prefill_bench --model $(TINY) --onnx $(ONNX) --tokens 2048 8192

serve: export
	$(K2TRT) serve --model $(TINY) --onnx $(ONNX) $(PIPE)

bench-serve: export
	$(K2TRT) bench-serve --model $(TINY) --onnx $(ONNX)

engines: install
	$(K2TRT) build --onnx $(ONNX) --out $(ENGINES)

compare: export
	$(K2TRT) compare --model $(TINY) --onnx $(ONNX)

gpu-check: install
	$(PY) -m k2trt.tools.gpu_check --markdown build/gpu-check.md

doctor: install
	$(K2TRT) doctor

clean:
	rm -rf build
