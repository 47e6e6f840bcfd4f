"""What a worker imports to host an actor, beyond laminar's own modules: imported once by
the forkserver that a local cluster's workers fork from (:data:`laminar.cluster.WORKER_PRELOAD`).

``transformers`` resolves its classes lazily: the first ``AutoTokenizer``,
``AutoModelForCausalLM`` or ``AutoConfig`` a worker touches imports their modules and, with
them, parts of torch and sympy — about 2.5 s of CPU (measured: a prompt pool took 2.5 s to
create, 2.5 s of it this import). Every worker of a run touches them (the prompt pool its
tokenizer, each rollout and trainer its model), so on two cores a run's start waited on
about three of them, and a worker the nanny brought back after a fault paid it again.
"""

from transformers import (  # noqa: F401 — imported for the forkserver, not used here
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)
