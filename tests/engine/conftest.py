"""The real-engine tier (``make test-engine``): vLLM's CPU build in its own environment, ``.venv-engine``
(``TREX_ENGINE_PYTHON`` names its interpreter). Without it the tier's module skips in one line."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # make_model.py, vllm_server.py
