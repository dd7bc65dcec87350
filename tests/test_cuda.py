"""The CUDA path on a GPU: a bounded session on the GPU keeps the same tokens and logits as on the CPU.

The real SmolLM2 weights are not needed for this equivalence (and cannot travel to the GPU machine this
project borrows), so the model here is a randomly initialised small Llama with SmolLM2's head layout
(9 query heads, 3 KV heads): said in the test name. Skipped where no GPU is present.
"""

import pytest
import torch
from run_ahead import check_run_ahead

from inf_mllm import StreamSession
from inf_mllm.spec import Recall

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton scoring path)")]


def random_small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from inf_mllm.attention import ATTN_IMPLEMENTATION, use_observing_attention

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=144, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         attn_implementation=ATTN_IMPLEMENTATION)
    model = LlamaForCausalLM(config).eval()
    use_observing_attention(model)
    return model


@pytest.mark.parametrize("policy", ["inf_mllm", "inf_mllm_plus", "h2o", "streaming_llm", "inf_mllm+prefixkv_budgets"])
def test_random_small_llama_on_cuda_keeps_the_cpu_tokens_and_logits(policy):
    torch.backends.cuda.matmul.allow_tf32 = False  # compare fp32 with fp32
    cpu_model = random_small_llama()
    gpu_model = random_small_llama().cuda()
    ids = torch.randint(0, 1000, (1, 400))
    kwargs = {"window": 16} if policy.startswith("inf_mllm") else {}
    cpu = StreamSession(cpu_model, None, policy, budget=128, **kwargs)
    gpu = StreamSession(gpu_model, None, policy, budget=128, **kwargs)
    for start in range(0, 400, 50):
        want = cpu.append(ids[:, start:start + 50])
        got = gpu.append(ids[:, start:start + 50].cuda())
        assert (got.cpu() - want).abs().max() <= 2e-3, (policy, start)
    assert gpu.kv_tokens == cpu.kv_tokens <= 128
    assert gpu.cache.layers[2].keys.is_cuda and gpu.cache.layers[2].keys.shape == cpu.cache.layers[2].keys.shape


def test_random_small_llama_recall_on_cuda_stores_turns_in_host_memory_and_links_them_back():
    """The span store keeps evicted turns in host memory (the GPU holds the bounded cache alone); a linked
    turn comes back to the GPU at the positions the CPU session gives it, with the same logits."""
    torch.backends.cuda.matmul.allow_tf32 = False
    sessions = {}
    for device in ("cpu", "cuda"):
        model = random_small_llama().to(device)
        session = StreamSession(model, None, "inf_mllm", budget=128, window=16,
                                recall=Recall(mode="oracle", layers=(1, 3)))
        ids = torch.randint(0, 1000, (1, 400), generator=torch.Generator().manual_seed(1))
        for turn, start in enumerate(range(0, 400, 50)):
            session.append(ids[:, start:start + 50].to(device), meta={"turn": turn})
        logits = session.append_question(ids[:, :8].to(device), oracle=lambda meta: meta["turn"] == 1)
        sessions[device] = (session, logits)
    (cpu, want), (gpu, got) = sessions["cpu"], sessions["cuda"]
    assert all(span.keys.device.type == "cpu" for span in gpu.store.spans.values())
    assert [i for i, _ in gpu.last_recalled] == [i for i, _ in cpu.last_recalled] == [1]
    assert gpu.cache.layers[2].keys.is_cuda and gpu.kv_tokens == cpu.kv_tokens
    assert (got.cpu() - want).abs().max() <= 2e-3


def test_random_small_llama_compiled_decode_on_cuda_runs_ahead_and_keeps_the_eager_answers():
    """On a GPU the compiled step (CUDA graphs) is launched before its token is handed over (`run_ahead`); answers
    that end at their last token, at an end token or at the consumer's break keep the eager step's tokens and cache,
    and only the steps of tokens that went on count. The real SmolLM2 weights cannot travel to the GPU machine."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_small_llama().cuda()
    ids = torch.randint(0, 1000, (1, 800), generator=torch.Generator().manual_seed(5)).cuda()
    eager = StreamSession(model, None, "inf_mllm", budget=256, window=16)
    ahead = StreamSession(model, None, "inf_mllm", budget=256, window=16, compile_decode=True)
    assert ahead.run_ahead and not eager._compiled
    check_run_ahead(eager, ahead, ids)


def test_random_small_llama_pool_slot_step_compiled_on_cuda_keeps_each_streams_answers():
    """Three streams in a pool whose decode steps run compiled in its slot arena (CUDA graphs, slots.py) answer what
    each answers alone, eagerly; one stream stops reading mid-answer, as a viewer who asks again does. The real SmolLM2
    weights cannot travel to the GPU machine."""
    import threading

    from inf_mllm.pool import SessionPool

    torch.backends.cuda.matmul.allow_tf32 = False
    model = random_small_llama().cuda()

    def script(session, n):
        g = torch.Generator().manual_seed(n)
        for _ in range(4):
            session.append(torch.randint(0, 1000, (1, 70 + 9 * n), generator=g).cuda())
        answers = []
        for q in range(3):
            session.append_question(torch.randint(0, 1000, (1, 8 + n), generator=g).cuda())
            tokens = []
            for t in session.generate(10, eos_token_id=[]):
                tokens.append(int(t[0]))
                if n == 1 and q == 1 and len(tokens) == 4:
                    break
            answers.append(tokens)
        return answers

    alone = [script(StreamSession(model, None, "inf_mllm", budget=256, window=16), n) for n in range(3)]
    pool = SessionPool(model, None, slots=3, compile_decode=True)
    pooled = [None] * 3

    def run(n):
        pooled[n] = script(pool.open("inf_mllm", budget=256, headroom=128, window=16), n)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    pool.close()
    assert pool.slot_decode.failed is None and pool.slot_decode.rows_advanced > pool.slot_decode.steps > 0
    assert pooled == alone
