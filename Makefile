# kvcache — plain GNU Make. `make test` (ASan+UBSan), `make tsan`, `make demo`, `make bench`, `make deps`.
CC      ?= cc
BUILD   := build
STB_INC ?= /usr/include/stb
WARN    := -std=c11 -Wall -Wextra -Wpedantic -Werror
BASE    := $(WARN) -D_GNU_SOURCE -I. -I$(STB_INC) -pthread
SAN     := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CFLAGS_TEST  := $(BASE) -g -O1 $(SAN)
CFLAGS_TSAN  := $(BASE) -g -O1 -fsanitize=thread
CFLAGS_OPT   := $(BASE) -O2 -g
HEADERS := kvblock.h kvoffload.h kvsched.h
TEST_HEADERS := $(wildcard tests/*.h)
NPROC   := $(shell nproc 2>/dev/null || echo 2)
MAKEFLAGS += -j$(NPROC)

TESTS        := $(patsubst tests/%.c,%,$(wildcard tests/test_*.c))
# tests that start threads; `make tsan` runs these under ThreadSanitizer
TSAN_TESTS   := test_pool_threads test_queue test_pipeline test_disk test_manager test_onboard test_offload_modes test_offload_stress test_remote
DEB_PACKAGES := libstb-dev libxxhash-dev libcjson-dev libhiredis-dev redis-server

.PHONY: all deps test tsan demo bench clean
all: deps $(BUILD)/quickstart $(BUILD)/serve_sim $(BUILD)/kvbench $(BUILD)/tiny_llm

# Install missing Debian packages (apt-get as root; otherwise print the command and stop).
deps:
	@missing=""; for p in $(DEB_PACKAGES); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	    if [ "$$(id -u)" = 0 ]; then \
	        echo "make deps: installing$$missing"; \
	        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing) >/dev/null || exit 1; \
	    else \
	        echo "make deps: missing packages; run: sudo apt-get install -y$$missing"; exit 1; \
	    fi; \
	fi

$(BUILD)/test/%: tests/%.c $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TEST) -o $@ $< -lm

$(BUILD)/tsan/%: tests/%.c $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TSAN) -o $@ $< -lm

# the G4 tier (kvremote.h, built with -DKVO_WITH_REDIS in the test) links hiredis; explicit rules win
# over the patterns above. Its tests start redis-server on loopback (skipped when it is not installed).
$(BUILD)/test/test_remote: tests/test_remote.c kvremote.h $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TEST) -o $@ $< -lhiredis -lm

$(BUILD)/tsan/test_remote: tests/test_remote.c kvremote.h $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TSAN) -o $@ $< -lhiredis -lm

# programs whose own check mode is part of the suite
CHECK_PROGRAMS := "$(BUILD)/tiny_llm --check" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru --eviction lineage" \
  "$(BUILD)/serve_sim --requests 300 --bytes --device-blocks 512 --host-blocks 1024 --disk-blocks 3000"

# ---- GPU tier: kvcuda.cu, built with nvcc when it is there (the rest of the build never needs it) ----
# `make cuda` -> build/libkvcuda.a; `make test` adds the CUDA tests (they skip without a device);
# `make bench-cuda` -> build/kvbench_cuda --json. sm_90 (Hopper) code plus compute_90 PTX for newer GPUs.
NVCC      ?= /usr/local/cuda/bin/nvcc
CUDA_LIB  ?= $(dir $(NVCC))../lib64
HAVE_NVCC := $(shell [ -x $(NVCC) ] && echo 1)
NVCC_ARCH := -gencode arch=compute_90,code=sm_90 -gencode arch=compute_90,code=compute_90
NVCCFLAGS := -std=c++17 -O2 -I. $(NVCC_ARCH) -Werror all-warnings \
             -Xcompiler -Wall,-Wextra,-Werror,-fno-exceptions,-fno-threadsafe-statics,-fno-asynchronous-unwind-tables
CUDA_LIBS := -L$(CUDA_LIB) -lcudart_static -ldl -lrt
# UBSan only: ASan's shadow memory and the CUDA driver's address-space reservations do not mix
CFLAGS_CUDA_TEST := $(BASE) -g -O1 -fsanitize=undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CUDA_TESTS := $(if $(HAVE_NVCC),$(BUILD)/cuda/test_cuda)
.PHONY: cuda bench-cuda

test: deps $(addprefix $(BUILD)/test/,$(TESTS)) $(BUILD)/tiny_llm $(BUILD)/serve_sim $(CUDA_TESTS)
	@sh tests/run.sh $(addprefix $(BUILD)/test/,$(TESTS)) $(CHECK_PROGRAMS) $(CUDA_TESTS)

tsan: deps $(addprefix $(BUILD)/tsan/,$(TSAN_TESTS))
	@TSAN_OPTIONS="halt_on_error=1" sh tests/run.sh $(addprefix $(BUILD)/tsan/,$(TSAN_TESTS))

$(BUILD)/quickstart: examples/quickstart.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

$(BUILD)/tiny_llm: examples/tiny_llm.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

$(BUILD)/serve_sim: examples/serve_sim.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lcjson -lm

demo: deps $(BUILD)/serve_sim
	./$(BUILD)/serve_sim

XXH_FLAGS := $(shell [ -f /usr/include/xxhash.h ] && echo "-DKVBENCH_HAVE_XXHASH")
XXH_LIBS  := $(shell [ -f /usr/include/xxhash.h ] && echo "-lxxhash")
$(BUILD)/kvbench: bench/kvbench.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -O3 $(XXH_FLAGS) -o $@ $< $(XXH_LIBS) -lm

bench: deps $(BUILD)/kvbench
	./$(BUILD)/kvbench

# ---- GPU tier rules (variables above `test`) ----
ifeq ($(HAVE_NVCC),1)
$(BUILD)/cuda/%.o: %.cu kvcuda.h kvblock.h kvoffload.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<

$(BUILD)/libkvcuda.a: $(BUILD)/cuda/kvcuda.o
	rm -f $@ && ar rcs $@ $^

$(BUILD)/cuda/test_cuda: tests/cuda/test_cuda.c tests/kvtest.h kvcuda.h kvblock.h kvoffload.h $(BUILD)/cuda/tests/cuda/test_kernels.o $(BUILD)/libkvcuda.a | deps
	$(CC) $(CFLAGS_CUDA_TEST) -o $@ $< $(BUILD)/cuda/tests/cuda/test_kernels.o $(BUILD)/libkvcuda.a $(CUDA_LIBS) -lm

$(BUILD)/kvbench_cuda: bench/kvbench_cuda.c kvcuda.h kvblock.h kvoffload.h $(BUILD)/libkvcuda.a | deps
	$(CC) $(CFLAGS_OPT) -o $@ $< $(BUILD)/libkvcuda.a $(CUDA_LIBS) -lm

cuda: $(BUILD)/libkvcuda.a

bench-cuda: $(BUILD)/kvbench_cuda
	./$(BUILD)/kvbench_cuda --json
else
cuda bench-cuda:
	@echo "make $@: nvcc not found at $(NVCC) (set NVCC=/path/to/nvcc)"; exit 1
endif

clean:
	rm -rf $(BUILD)
