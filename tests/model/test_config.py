"""Model configuration files: a field of the wrong type or sign is refused, naming the model and the field."""
import pytest

from starscream_jax.errors import StarscreamError
from starscream_jax.model.catalog import list_model_configs, load_model_config

TINY = (
    'name = "broken"\nvocab_size = 256\nd_model = 128\nn_layers = 4\nn_heads = 8\nn_kv_heads = 4\nhead_dim = 16\n'
    "d_ff = 384\n"
)


@pytest.mark.parametrize("change, message", [
    ("n_layers = 0", "model broken: n_layers 0: must be at least 1"),
    ("d_model = -128", "model broken: d_model -128: must be at least 1"),
    ("n_kv_heads = 0", "model broken: n_kv_heads 0: must be at least 1"),
    ('d_ff = "384"', "model broken: d_ff '384': expected a whole number"),
    ("head_dim = 16.0", "model broken: head_dim 16.0: expected a whole number"),
    ("norm_eps = -1e-5", "model broken: norm_eps -1e-05: must be a finite number above zero"),
    ("rope_factor = 0.0", "model broken: rope_factor 0.0: must be a finite number above zero"),
    ("n_experts = -1", "model broken: n_experts -1: must be at least 0"),
    ('tie_embeddings = "yes"', "model broken: tie_embeddings 'yes'; use true or false"),
    ('mlp_activation = "gelu"', r"model broken: mlp_activation 'gelu'; use one of silu, gelu_tanh"),
    ("attn_softcap = -50.0", "model broken: attn_softcap -50.0: must be a finite number zero or more"),
    ("sliding_window = 4096", r"sliding_window 4096 with sliding_layers \[\]; give both .* or neither"),
    ("sliding_layers = [0, 2]", r"sliding_window 0 with sliding_layers \[0, 2\]; give both"),
    ("sliding_layers = [0, 4]", r"sliding_layers \[0, 4\] must be distinct layer indices in 0..3"),
    ('post_norms = "yes"', "model broken: post_norms 'yes'; use true or false"),
    ("rope_low_freq_factor = 0.0", "model broken: rope_low_freq_factor 0.0: must be a finite number above zero"),
    ('rope_high_freq_factor = "4"', "model broken: rope_high_freq_factor '4': expected a number"),
    ('rope_original_max_len = "8192"', "model broken: rope_original_max_len '8192': expected a whole number"),
    ("load_balance_weight = nan", "model broken: load_balance_weight nan is not a finite number; give 0 .off."),
    ('load_balance_weight = "0.01"', "model broken: load_balance_weight '0.01' is not a finite number"),
    ("name = 5", r"model name 5: expected a non-empty string; write name = \"my-model\""),
    ('name = " "', "model name ' ': expected a non-empty string"),
    ('eight_bit_matmul = "cublas"', r"model broken: eight_bit_matmul 'cublas'; use one of '', 'pallas', "
                                    r"'interpret', 'xla'"),
])
def test_fields_of_the_wrong_type_or_sign_are_refused(tmp_path, change, message):
    field = change.split(" = ")[0]
    lines = [line for line in TINY.splitlines() if not line.startswith(field + " ")] + [change]
    path = tmp_path / "broken.toml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(StarscreamError, match=message):
        load_model_config(path)


def test_gemma2_fields_read_from_toml(tmp_path):
    """Gemma 2's fields as a TOML file gives them: the sliding layers as a list, held as a tuple."""
    path = tmp_path / "gemma.toml"
    path.write_text(TINY + 'mlp_activation = "gelu_tanh"\nnorm_plus_one = true\npost_norms = true\n'
                    "scale_embedding = true\nattn_softcap = 50.0\nlogit_softcap = 30.0\n"
                    "query_pre_attn_scalar = 256.0\nsliding_window = 4096\nsliding_layers = [0, 2]\n")
    config = load_model_config(path)
    assert config.sliding_layers == (0, 2) and hash(config)
    assert config.num_params() == load_model_config(path).replace(post_norms=False).num_params() + 4 * 2 * 128


def test_every_shipped_model_passes_the_checks():
    assert all(load_model_config(name).n_layers >= 1 for name in list_model_configs())


def test_a_new_depth_repeats_the_sliding_pattern_by_its_period():
    """inspect and plan compile 2 layers and scale to the full depth: Gemma 2 27B's alternating local and global
    layers give one of each at 2 layers and the 23 even layers again at 46; a pattern that does not repeat keeps
    its first layers; a depth change with sliding_layers given takes them as given."""
    gemma = load_model_config("gemma2-27b")
    assert gemma.sliding_layers == tuple(range(0, 46, 2)) and gemma.sliding_window == 4096
    assert gemma.replace(n_layers=2).sliding_layers == (0,)
    assert gemma.replace(n_layers=2).replace(n_layers=46) == gemma
    local_first = gemma.replace(n_layers=6, sliding_layers=(0, 1, 2, 3, 4))  # Gemma 3's five local, one global
    assert local_first.replace(n_layers=12).sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    aperiodic = gemma.replace(n_layers=5, sliding_layers=(0, 1, 3))
    assert aperiodic.replace(n_layers=3).sliding_layers == (0, 1)
