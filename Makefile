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
TSAN_TESTS   := test_pool_threads test_queue test_pipeline test_disk test_manager test_onboard test_offload_modes test_offload_stress
DEB_PACKAGES := libstb-dev libxxhash-dev libcjson-dev

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

# programs whose own check mode is part of the suite
CHECK_PROGRAMS := "$(BUILD)/tiny_llm --check" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru" \
  "$(BUILD)/serve_sim --sequential --trace examples/traces/small.jsonl --device-blocks 64 --host-blocks 0 --check-lru --eviction lineage" \
  "$(BUILD)/serve_sim --requests 300 --bytes --device-blocks 512 --host-blocks 1024 --disk-blocks 3000"

test: deps $(addprefix $(BUILD)/test/,$(TESTS)) $(BUILD)/tiny_llm $(BUILD)/serve_sim
	@sh tests/run.sh $(addprefix $(BUILD)/test/,$(TESTS)) $(CHECK_PROGRAMS)

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

clean:
	rm -rf $(BUILD)
