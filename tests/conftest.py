import pytest

from costmodel import TransformerDims, transformer_workload

# A search limit that a proof of infeasibility never reaches, even with the suite's workers sharing
# the cores: a test that expects "nothing fits" must not read the default limit's timeout instead.
NEVER_S = 120.0


@pytest.fixture(scope="session")
def gpt_22b():
    """Korthikanti et al. 2022's 22B GPT (Table 3), GPT-era conventions."""
    return transformer_workload(
        TransformerDims(name="gpt-22b", n_layers=48, hidden=6144, heads=64, vocab=51200, seq_len=2048, dropout=True, flash_attention=False)
    )


@pytest.fixture(scope="session")
def llama_70b():
    return transformer_workload(
        TransformerDims(name="llama-70b", n_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, vocab=128256,
                        seq_len=4096, gated_mlp=True, dropout=False, biases=False, learned_positions=False)
    )


@pytest.fixture(scope="session")
def small_gpt():
    return transformer_workload(TransformerDims(name="gpt-small", n_layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024))
