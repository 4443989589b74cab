"""The advisor: parallelism, memory, time and cost for models and clusters you do not
have here, from published formulas (ZeRO, Korthikanti et al., Narayanan et al., NeMo's
Auto Configurator) and presets (``strategies/advise``). Imports no JAX until a method,
a dry run or the local topology is asked for.

    from jaxdist import advise
    model = advise.ModelSpec.from_preset("llama-3.1-70b")
    cluster = advise.Cluster(16, devices_per_node=8, device="h100-80gb")
    advice = advise.recommend(model, cluster, global_batch_size=512, seq_len=4096)
    print(advice.best.summary()); method = advice.best.method()
"""

from jaxdist.advise.cluster import Cluster as Cluster
from jaxdist.advise.cluster import devices as devices
from jaxdist.advise.cluster import topology as topology
from jaxdist.advise.config import ParallelConfig as ParallelConfig
from jaxdist.advise.config import validate as validate
from jaxdist.advise.evaluate import Evaluation as Evaluation
from jaxdist.advise.evaluate import evaluate as evaluate
from jaxdist.advise.launch import host_env as host_env
from jaxdist.advise.launch import local_command as local_command
from jaxdist.advise.launch import python_code as python_code
from jaxdist.advise.launch import slurm_script as slurm_script
from jaxdist.advise.memory import activation_bytes_per_layer as activation_bytes_per_layer
from jaxdist.advise.recommend import Advice as Advice
from jaxdist.advise.recommend import grid as grid
from jaxdist.advise.recommend import recommend as recommend
from jaxdist.advise.sizing import model_size as model_size
from jaxdist.advise.sizing import training_days as training_days
from jaxdist.advise.specs import ModelSpec as ModelSpec
from jaxdist.advise.specs import presets as presets

__all__ = ["Advice", "Cluster", "Evaluation", "ModelSpec", "ParallelConfig",
           "activation_bytes_per_layer", "devices", "evaluate", "grid", "host_env",
           "local_command", "model_size", "presets", "python_code", "recommend", "slurm_script",
           "topology", "training_days", "validate"]
