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
HEADERS := kvblock.h kvoffload.h kvsched.h kvroute.h
TEST_HEADERS := $(wildcard tests/*.h)
NPROC   := $(shell nproc 2>/dev/null || echo 2)
MAKEFLAGS += -j$(NPROC)

TESTS        := $(patsubst tests/%.c,%,$(wildcard tests/test_*.c))
# tests that start threads; `make tsan` runs these under ThreadSanitizer
TSAN_TESTS   := test_observe test_pool_threads test_queue test_pipeline test_disk test_manager test_connector test_onboard test_offload_modes test_offload_stress test_remote test_router
DEB_PACKAGES := libstb-dev libxxhash-dev libcjson-dev libhiredis-dev redis-server tmux

.PHONY: all deps test tsan demo bench clean
all: deps $(BUILD)/quickstart $(BUILD)/serve_sim $(BUILD)/kvbench $(BUILD)/tiny_llm $(BUILD)/kvtop $(BUILD)/workloads

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

# tests that read the workload generator of examples/ (the pattern rules above build them)
$(BUILD)/test/test_arc_reference $(BUILD)/test-single/test_arc_reference: examples/workloads.h

# test_hash_portable is test_hash.c with KVB_NO_INT128 (the portable multiply): it includes that file
$(BUILD)/test/test_hash_portable $(BUILD)/tsan/test_hash_portable $(BUILD)/test-single/test_hash_portable: tests/test_hash.c

# the G4 tier (kvremote.h, built with -DKVO_WITH_REDIS in the test) links hiredis; explicit rules win
# over the patterns above. Its tests start redis-server on loopback (skipped when it is not installed).
$(BUILD)/test/test_remote: tests/test_remote.c kvremote.h $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TEST) -o $@ $< -lhiredis -lm

$(BUILD)/tsan/test_remote: tests/test_remote.c kvremote.h $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_TSAN) -o $@ $< -lhiredis -lm

# the policy sweep replays ~40 million blocks: optimised, no sanitizers (the policy code runs under them
# in test_fol and test_arc_s3fifo); it reads the workload generator of examples/
$(BUILD)/test/test_policy_workloads: tests/test_policy_workloads.c examples/workloads.h $(TEST_HEADERS) $(HEADERS) | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

# programs whose own check mode is part of the suite
CHECK_PROGRAMS := "$(BUILD)/tiny_llm --check" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru --eviction lineage" \
  "sh tests/eviction_sim.sh" \
  "$(BUILD)/serve_sim --requests 300 --bytes --device-blocks 512 --host-blocks 1024 --disk-blocks 3000" \
  "sh tests/remote_sim.sh" \
  "sh tests/fleet_sim.sh" \
  "sh tests/fleet_cluster.sh" \
  "sh tests/kvtop_tmux.sh" \
  "sh tests/bench_smoke.sh $(BUILD)/kvbench"

# ---- GPU tier: kvcuda.cu, built with nvcc when it is there (the rest of the build never needs it) ----
# `make cuda` -> build/libkvcuda.a; `make test` adds the CUDA tests (they skip without a device);
# `make bench-cuda` -> build/kvbench_cuda --json.
# Architectures: SASS for the GPUs people have (sm_80 A100, sm_86 A10 / RTX 30xx, sm_89 L4 / L40S /
# RTX 40xx, sm_90 H100 / H200), plus sm_100 / sm_120 (Blackwell) when this nvcc lists them, and PTX for
# the oldest, which the driver JIT-compiles on any newer GPU. `make cuda CUDA_ARCHS="86"` builds only
# what you name (a change of the list rebuilds the CUDA objects).
NVCC      ?= /usr/local/cuda/bin/nvcc
CUDA_LIB  ?= $(dir $(NVCC))../lib64
HAVE_NVCC := $(shell [ -x $(NVCC) ] && echo 1)
NVCC_CODES := $(if $(HAVE_NVCC),$(shell $(NVCC) --list-gpu-code 2>/dev/null || $(NVCC) --list-gpu-arch 2>/dev/null))
CUDA_ARCHS ?= 80 86 89 90 $(foreach a,100 120,$(if $(filter sm_$(a) compute_$(a),$(NVCC_CODES)),$(a)))
CUDA_PTX   ?= $(shell printf '%s\n' $(CUDA_ARCHS) | sort -n | head -n 1)
NVCC_ARCH := $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
             -gencode arch=compute_$(CUDA_PTX),code=compute_$(CUDA_PTX)
NVCCFLAGS := -std=c++17 -O2 -I. $(NVCC_ARCH) -Werror all-warnings \
             -Xcompiler -Wall,-Wextra,-Werror,-fno-exceptions,-fno-threadsafe-statics,-fno-asynchronous-unwind-tables
CUDA_LIBS := -L$(CUDA_LIB) -lcudart_static -ldl -lrt
# UBSan only: ASan's shadow memory and the CUDA driver's address-space reservations do not mix
CFLAGS_CUDA_TEST := $(BASE) -g -O1 -fsanitize=undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
CUDA_TESTS := $(if $(HAVE_NVCC),$(BUILD)/cuda/test_cuda)
.PHONY: cuda bench-cuda

test: deps $(addprefix $(BUILD)/test/,$(TESTS)) $(BUILD)/tiny_llm $(BUILD)/serve_sim $(BUILD)/kvtop $(BUILD)/workloads $(BUILD)/kvbench $(CUDA_TESTS)
	@sh tests/run.sh $(addprefix $(BUILD)/test/,$(TESTS)) $(CHECK_PROGRAMS) $(CUDA_TESTS) $(TEST_MORE)

tsan: deps $(addprefix $(BUILD)/tsan/,$(TSAN_TESTS))
	@TSAN_OPTIONS="halt_on_error=1" sh tests/run.sh $(addprefix $(BUILD)/tsan/,$(TSAN_TESTS))

$(BUILD)/quickstart: examples/quickstart.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

$(BUILD)/tiny_llm: examples/tiny_llm.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

# serve_sim: main and options in examples/serve_sim.c, one file per concern in examples/serve_sim/
SERVE_SIM_SRC := examples/serve_sim.c $(wildcard examples/serve_sim/*.c)
$(BUILD)/serve_sim: $(SERVE_SIM_SRC) $(wildcard examples/serve_sim/*.h) kvremote.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -DKVO_WITH_REDIS -o $@ $(SERVE_SIM_SRC) -lcjson -lhiredis -lm

# the console (issue 7): attaches to serve_sim --console PATH, or reads serve_sim --record FILE
$(BUILD)/kvtop: examples/kvtop.c $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

# production-like traces and the eviction policies' sweep over them (issue 14)
$(BUILD)/workloads: examples/workloads.c examples/workloads.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -o $@ $< -lm

demo: deps $(BUILD)/serve_sim
	./$(BUILD)/serve_sim

# issue 16: N serve_sim processes (--shard i/N) on a 3-node Redis Cluster on loopback as their shared G4,
# next to the same processes alone; ports chosen free, everything removed at exit
.PHONY: demo-fleet
demo-fleet: deps $(BUILD)/serve_sim
	sh examples/demo_fleet.sh

XXH_FLAGS := $(shell [ -f /usr/include/xxhash.h ] && echo "-DKVBENCH_HAVE_XXHASH")
XXH_LIBS  := $(shell [ -f /usr/include/xxhash.h ] && echo "-lxxhash")
$(BUILD)/kvbench: bench/kvbench.c bench/kvbench_remote.h kvremote.h tests/redis_fixtures.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -O3 -DKVO_WITH_REDIS $(XXH_FLAGS) -o $@ $< $(XXH_LIBS) -lhiredis -lm

bench: deps $(BUILD)/kvbench
	./$(BUILD)/kvbench

# the G4 tier over loopback: starts its own redis-server (says "skipped" without one)
$(BUILD)/kvbench_remote: bench/kvbench_remote.c bench/kvbench_remote.h kvremote.h tests/redis_fixtures.h $(HEADERS) | deps
	@mkdir -p $(BUILD)
	$(CC) $(CFLAGS_OPT) -O3 -o $@ $< -lhiredis -lm

.PHONY: bench-remote
bench-remote: deps $(BUILD)/kvbench_remote
	./$(BUILD)/kvbench_remote

# ---- GPU tier rules (variables above `test`) ----
ifeq ($(HAVE_NVCC),1)
# The architecture flags, kept in a file that changes only when they do, so that another CUDA_ARCHS rebuilds.
.PHONY: FORCE
$(BUILD)/cuda/arch-flags: FORCE
	@mkdir -p $(dir $@)
	@echo '$(NVCC_ARCH)' | cmp -s - $@ || echo '$(NVCC_ARCH)' >$@

$(BUILD)/cuda/%.o: %.cu kvcuda.h kvblock.h kvoffload.h $(BUILD)/cuda/arch-flags
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c -o $@ $<

$(BUILD)/libkvcuda.a: $(BUILD)/cuda/kvcuda.o
	rm -f $@ && ar rcs $@ $^

$(BUILD)/cuda/test_cuda: tests/cuda/test_cuda.c tests/kvtest.h kvcuda.h kvblock.h kvoffload.h $(BUILD)/cuda/tests/cuda/test_kernels.o $(BUILD)/libkvcuda.a | deps
	$(CC) $(CFLAGS_CUDA_TEST) -o $@ $< $(BUILD)/cuda/tests/cuda/test_kernels.o $(BUILD)/libkvcuda.a $(CUDA_LIBS) -lm

$(BUILD)/kvbench_cuda: bench/kvbench_cuda.c kvcuda.h kvblock.h kvoffload.h $(BUILD)/cuda/bench/kvbench_cuda_floor.o $(BUILD)/libkvcuda.a | deps
	$(CC) $(CFLAGS_OPT) -o $@ $< $(BUILD)/cuda/bench/kvbench_cuda_floor.o $(BUILD)/libkvcuda.a $(CUDA_LIBS) -lm

# tiny_llm --check --gpu: its fork check with the pool in GPU memory (copy-on-write on the device)
$(BUILD)/tiny_llm_cuda: examples/tiny_llm.c kvcuda.h $(HEADERS) $(BUILD)/libkvcuda.a | deps
	$(CC) $(CFLAGS_OPT) -DTINY_LLM_CUDA -o $@ $< $(BUILD)/libkvcuda.a $(CUDA_LIBS) -lm

cuda: $(BUILD)/libkvcuda.a

bench-cuda: $(BUILD)/kvbench_cuda
	./$(BUILD)/kvbench_cuda --json
else
cuda bench-cuda:
	@echo "make $@: nvcc not found at $(NVCC) (set NVCC=/path/to/nvcc)"; exit 1
endif

# The GPU proof in one command (tests/gpu_check.sh): with a GPU, build for its architecture, run the
# CUDA tests (none may skip), kvbench_cuda --json and tiny_llm --check --gpu, and write
# build/gpu-check.json; without one, say so in one line and succeed.
.PHONY: gpu-check
gpu-check:
	@BUILD=$(BUILD) NVCC=$(NVCC) MAKE="$(MAKE)" sh tests/gpu_check.sh

clean:
	rm -rf $(BUILD)

# ---- single file, compile matrix, fuzzing, install (issue 10) ----------------------------------------
# `make test` also runs every test against kvcache.h, the compile matrix and the fuzz corpus, all counted
# in its one summary line.
.PHONY: amalgamate check-amalgamation test-single matrix fuzz fuzz-diff fuzz-sched install uninstall
AMALG_PARTS   := $(wildcard kvblock.h kvoffload.h kvremote.h kvsched.h kvroute.h kvcuda.h)
OTHER_HEADERS := $(filter-out $(AMALG_PARTS) kvcache.h,$(wildcard kv*.h))
DEB_PACKAGES  += clang libclang-rt-dev g++ pkg-config

amalgamate:
	sh amalgamate.sh

# kvcache.h is generated and committed; this fails while it differs from what amalgamate.sh writes.
check-amalgamation:
	@mkdir -p $(BUILD)
	@sh amalgamate.sh $(BUILD)/kvcache.h
	@if cmp -s kvcache.h $(BUILD)/kvcache.h; then echo "kvcache.h is up to date"; \
	else diff -u kvcache.h $(BUILD)/kvcache.h | head -40; \
	    echo "kvcache.h differs from amalgamate.sh's output: run sh amalgamate.sh (or make amalgamate)"; exit 1; fi

# The single-file suite: each test compiled against kvcache.h as amalgamate.sh writes it from the current
# headers (the matrix checks that the committed kvcache.h is that same file). build/single holds it and,
# under the split headers' names, shims that include it; it comes first on the include path, `.` not at all
# (the headers outside kvcache.h are copied in, so that their own includes of the parts find the shims).
SINGLE_INC    := $(BUILD)/single
SINGLE_TESTS  := $(addprefix $(BUILD)/test-single/,$(TESTS))
CFLAGS_SINGLE := $(WARN) -D_GNU_SOURCE -I$(SINGLE_INC) -I$(STB_INC) -pthread -g -O1 $(SAN)

$(SINGLE_INC)/kvcache.h: amalgamate.sh $(AMALG_PARTS) $(OTHER_HEADERS)
	@mkdir -p $(@D)
	@sh amalgamate.sh $@
	@for h in $(AMALG_PARTS); do echo '#include "kvcache.h" /* test-single: the split name, served by the single file */' >$(@D)/$$h; done
	@$(if $(OTHER_HEADERS),cp $(OTHER_HEADERS) $(@D)/)

# tests that link more than libm, as their split rules above
SINGLE_LIBS_test_remote := -lhiredis

$(BUILD)/test-single/test_policy_workloads: tests/test_policy_workloads.c examples/workloads.h $(TEST_HEADERS) $(SINGLE_INC)/kvcache.h | deps
	@mkdir -p $(dir $@)
	$(CC) $(WARN) -D_GNU_SOURCE -I$(SINGLE_INC) -I$(STB_INC) -pthread -O2 -g -o $@ $< -lm

$(BUILD)/test-single/%: tests/%.c $(TEST_HEADERS) $(SINGLE_INC)/kvcache.h | deps
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS_SINGLE) -o $@ $< $(SINGLE_LIBS_$*) -lm

test-single: deps $(SINGLE_TESTS)
	@sh tests/run.sh $(SINGLE_TESTS)

# The compile matrix, tests/compile/matrix.sh: compile-only but for the link, static-mode, example, README
# and install entries. -Werror everywhere; each header (those outside kvcache.h too, without static mode)
# with gcc -O0, clang, g++ and clang++ (the last three -fsyntax-only), and kvcache.h (all its code) also
# with gcc -O2 and -O3, where -Wmaybe-uninitialized runs.
#   C11:   -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wconversion -Wsign-conversion (gcc and clang).
#   C++17: -Wall -Wextra -Wpedantic -Wshadow; g++ also -Wconversion -Wsign-conversion.
#   static mode (KVB_STATIC, KVO_STATIC, KVS_STATIC): the same flags, no waiver (the *_API macros mark
#          static functions unused, so a program need not call every one).
MATRIX_WARN_C       := -std=c11 -Wall -Wextra -Wpedantic -Werror -Wshadow -Wstrict-prototypes
MATRIX_WARN_CXX     := -std=c++17 -Wall -Wextra -Wpedantic -Werror -Wshadow
MATRIX_CONV_GCC     := -Wconversion -Wsign-conversion
MATRIX_CONV_CLANG   := $(MATRIX_CONV_GCC)
MATRIX_STATIC_WAIVE :=
MATRIX_RUN          := "sh tests/compile/matrix.sh"
test matrix: export MATRIX_DIR           := $(BUILD)/matrix
test matrix: export MATRIX_PARTS         := $(AMALG_PARTS)
test matrix: export MATRIX_OTHER_HEADERS := $(OTHER_HEADERS)
test matrix: export MATRIX_STB_INC       := $(STB_INC)
test matrix: export MATRIX_CUDA_LIB      := $(BUILD)/libkvcuda.a
test matrix: export MATRIX_JOBS          := $(NPROC)
test matrix: export MATRIX_MAKE          := $(MAKE)
test matrix: export MATRIX_WARN_C        := $(MATRIX_WARN_C)
test matrix: export MATRIX_WARN_CXX      := $(MATRIX_WARN_CXX)
test matrix: export MATRIX_CONV_GCC      := $(MATRIX_CONV_GCC)
test matrix: export MATRIX_CONV_CLANG    := $(MATRIX_CONV_CLANG)
test matrix: export MATRIX_STATIC_WAIVE  := $(MATRIX_STATIC_WAIVE)

matrix: deps
	@sh tests/run.sh $(MATRIX_RUN)

# Fuzzing: libFuzzer (clang) from the checked-in corpus; new inputs go to build/fuzz/found, a crash to
# build/fuzz/crash-*. `make test` replays the corpus once with build/fuzz/replay (any compiler).
FUZZ_SECONDS ?= 60
FUZZ_CC      ?= clang
# Sanitizers beside libFuzzer's own. A long run (issue 15 asks 10 million executions of fuzz_diff) may set
# `FUZZ_SAN=` and a BUILD of its own: about 3x the executions per second, still checked call by call.
FUZZ_SAN     ?= ,address,undefined
$(BUILD)/fuzz/fuzz_ops: tests/fuzz/fuzz_ops.c tests/fuzz/fuzz_replay.h tests/fuzz/fuzz_backend.h $(AMALG_PARTS) | deps
	@mkdir -p $(@D)
	$(FUZZ_CC) $(WARN) -D_GNU_SOURCE -I. -I$(STB_INC) -pthread -g -O1 -fsanitize=fuzzer$(FUZZ_SAN) \
	    -fno-sanitize-recover=all -o $@ $< -lm

$(BUILD)/fuzz/replay: tests/fuzz/fuzz_ops.c tests/fuzz/fuzz_replay.h tests/fuzz/fuzz_backend.h $(AMALG_PARTS) | deps
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_TEST) -DKVFUZZ_REPLAY -o $@ $< -lm

# The differential target (issue 15): kvblock.h against a plain reference model, call by call.
$(BUILD)/fuzz/fuzz_diff: tests/fuzz/fuzz_diff.c kvblock.h | deps
	@mkdir -p $(@D)
	$(FUZZ_CC) $(WARN) -D_GNU_SOURCE -I. -I$(STB_INC) -pthread -g -O1 -fsanitize=fuzzer$(FUZZ_SAN) \
	    -fno-sanitize-recover=all -o $@ $< -lm

$(BUILD)/fuzz/replay_diff: tests/fuzz/fuzz_diff.c tests/fuzz/fuzz_replay.h kvblock.h | deps
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_TEST) -DKVFUZZ_REPLAY -o $@ $< -lm

# The scheduler target: kvsched.h driven like an engine, checked against the harness's own model.
$(BUILD)/fuzz/fuzz_sched: tests/fuzz/fuzz_sched.c tests/fuzz/fuzz_backend.h $(AMALG_PARTS) | deps
	@mkdir -p $(@D)
	$(FUZZ_CC) $(WARN) -D_GNU_SOURCE -I. -I$(STB_INC) -pthread -g -O1 -fsanitize=fuzzer$(FUZZ_SAN) \
	    -fno-sanitize-recover=all -o $@ $< -lm

$(BUILD)/fuzz/replay_sched: tests/fuzz/fuzz_sched.c tests/fuzz/fuzz_replay.h tests/fuzz/fuzz_backend.h $(AMALG_PARTS) | deps
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_TEST) -DKVFUZZ_REPLAY -o $@ $< -lm

fuzz: deps $(BUILD)/fuzz/fuzz_ops
	@mkdir -p $(BUILD)/fuzz/found
	./$(BUILD)/fuzz/fuzz_ops -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(BUILD)/fuzz/ $(BUILD)/fuzz/found tests/fuzz/corpus

fuzz-sched: deps $(BUILD)/fuzz/fuzz_sched
	@mkdir -p $(BUILD)/fuzz/found_sched
	./$(BUILD)/fuzz/fuzz_sched -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(BUILD)/fuzz/sched- $(BUILD)/fuzz/found_sched tests/fuzz/corpus_sched

fuzz-diff: deps $(BUILD)/fuzz/fuzz_diff
	@mkdir -p $(BUILD)/fuzz/found_diff
	./$(BUILD)/fuzz/fuzz_diff -max_total_time=$(FUZZ_SECONDS) -timeout=10 -print_final_stats=1 \
	    -artifact_prefix=$(BUILD)/fuzz/diff- $(BUILD)/fuzz/found_diff tests/fuzz/corpus_diff

# What `make test` runs after the split suite (tests/run.sh takes commands).
test: $(SINGLE_TESTS) $(BUILD)/fuzz/replay $(BUILD)/fuzz/replay_diff $(BUILD)/fuzz/replay_sched
TEST_MORE := $(SINGLE_TESTS) $(MATRIX_RUN) $(BUILD)/fuzz/replay $(BUILD)/fuzz/replay_diff $(BUILD)/fuzz/replay_sched

# Install every header, kvcache.h and kvcache.pc (header-only, so share/pkgconfig), and build/libkvcuda.a
# into LIBDIR when `make cuda` built it (link it as kvcuda.h says); DESTDIR is honoured.
PREFIX       ?= /usr/local
INCLUDEDIR   ?= $(PREFIX)/include
LIBDIR       ?= $(PREFIX)/lib
PKGCONFIGDIR ?= $(PREFIX)/share/pkgconfig
PC_VERSION    = $(shell sed -n 's/^.define KVCACHE_VERSION_[A-Z]* \([0-9]*\)$$/\1/p' kvcache.h | paste -sd. -)

install: check-amalgamation
	install -d $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(PKGCONFIGDIR)
	install -m 644 $(AMALG_PARTS) kvcache.h $(DESTDIR)$(INCLUDEDIR)/
	if [ -f $(BUILD)/libkvcuda.a ]; then install -d $(DESTDIR)$(LIBDIR) && \
	    install -m 644 $(BUILD)/libkvcuda.a $(DESTDIR)$(LIBDIR)/; fi
	printf '%s\n' 'prefix=$(PREFIX)' 'includedir=$(INCLUDEDIR)' '' 'Name: kvcache' \
	    'Description: tiered KV-cache block manager for LLM inference engines (header-only C11)' \
	    'Version: $(PC_VERSION)' 'Cflags: -I$(INCLUDEDIR) -I$(STB_INC) -pthread' 'Libs: -pthread' \
	    >$(DESTDIR)$(PKGCONFIGDIR)/kvcache.pc

uninstall:
	rm -f $(addprefix $(DESTDIR)$(INCLUDEDIR)/,$(AMALG_PARTS) kvcache.h) $(DESTDIR)$(PKGCONFIGDIR)/kvcache.pc \
	    $(DESTDIR)$(LIBDIR)/libkvcuda.a
