"""The opt-in oneDNN products (`inf_mllm/linear.py`) against `nn.Linear`: the same products to 1e-4 for one row, a few
and a prefill's many; the same greedy tokens from the real SmolLM2-135M through a real session; tiny-vlm switched by
its variable, and a bad value said in one line."""

import pytest
import torch
from torch import nn

from inf_mllm import StreamSession, load_model
from inf_mllm import linear as L

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")

TEXT = ("The river runs past the old mill, where a red boat is tied to the pier. Two children throw bread to the "
        "ducks while their father reads a newspaper on a bench. Later a bus stops at the bridge and a woman with a "
        "green umbrella gets off.")


@pytest.mark.parametrize("shape", [(1, 1), (4, 1), (1, 300)])
def test_a_packed_layer_computes_what_nn_linear_does(shape):
    torch.manual_seed(0)
    layer = nn.Linear(576, 1536, bias=False)
    x = torch.randn(*shape, 576)
    with torch.no_grad():
        torch.testing.assert_close(L.OneDnnLinear(layer)(x), layer(x), atol=1e-4, rtol=0)


def test_smollm2_on_onednn_answers_with_the_same_tokens(smol):
    model, tok = smol
    fast = L.use_onednn(load_model()[0])
    assert isinstance(fast.lm_head, L.OneDnnLinear)
    assert all(isinstance(m, L.OneDnnLinear) for m in (fast.model.layers[0].self_attn.q_proj,
                                                       fast.model.layers[-1].mlp.down_proj))
    assert not any(type(m) is nn.Linear for m in fast.modules())
    story = tok(TEXT, return_tensors="pt").input_ids
    question = tok("\nWhat colour is the umbrella, and where is the boat tied?\nAnswer:", return_tensors="pt").input_ids

    def tokens(m):
        session = StreamSession(m, tok, "inf_mllm", budget=512)
        session.append(story)
        session.append_question(question)
        return [int(t[0]) for t in session.generate(24, eos_token_id=[])]

    assert tokens(fast) == tokens(model)


def test_tiny_vlm_takes_its_products_from_the_variable(monkeypatch):
    from models.tiny_vlm.model import TinyVLM

    monkeypatch.setenv(L.ENV, "onednn")
    assert isinstance(TinyVLM().model.model.layers[0].mlp.up_proj, L.OneDnnLinear)
    monkeypatch.setenv(L.ENV, "fast")
    with pytest.raises(ValueError, match=r"^INF_MLLM_LINEAR='fast': choose torch or onednn$"):
        TinyVLM()
