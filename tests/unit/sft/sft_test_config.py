"""Small config of the SFT tests (a model and task small enough for seconds per step on 2 cores)."""

from rstar2_core.config import load_config

SMALL = ["model.tiny.hidden_size=64", "model.tiny.num_layers=2", "model.tiny.num_heads=4", "model.tiny.num_kv_heads=2",
         "model.tiny.intermediate_size=128", "model.tiny.vocab_size=600", "data.synthetic.n_sft=16",
         "data.synthetic.fail_first_share=0.25", "sft.max_seq_len=1024", "sft.batch_size=4", "sft.micro_batch_size=2",
         "sft.lr=3e-3", "sft.warmup_ratio=0.1", "sft.checkpoint_every=0", "sft.epochs=1",
         # a fixed pass on a cosine, as the paper trains (the tests of convergence set their own criterion)
         "sft.schedule=cosine", "sft.converged_loss=null", "sft.steps_after_converged=null"]


def small_cfg(*extra: str):
    return load_config("tiny", SMALL + list(extra))
