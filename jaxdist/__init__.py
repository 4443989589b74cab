"""jaxdist: automatic parallelization of JAX training steps."""

from jaxdist import advise as advise
from jaxdist import checkpoint as checkpoint
from jaxdist import errors as errors
from jaxdist.api import ParallelizedFunc as ParallelizedFunc
from jaxdist.api import parallelize as parallelize
from jaxdist.calibration import calibrate as calibrate
from jaxdist.estimate import Estimate as Estimate
from jaxdist.estimate import StageEstimate as StageEstimate
from jaxdist.estimate import estimate as estimate
from jaxdist.executable import Executable as Executable
from jaxdist.grad import grad as grad
from jaxdist.grad import value_and_grad as value_and_grad
from jaxdist.launch import init_distributed as init_distributed
from jaxdist.mesh import LogicalMesh as LogicalMesh
from jaxdist.methods import AutoShardingOption as AutoShardingOption
from jaxdist.methods import CreateStateParallel as CreateStateParallel
from jaxdist.methods import DataParallel as DataParallel
from jaxdist.methods import FollowParallel as FollowParallel
from jaxdist.methods import ManualStageOption as ManualStageOption
from jaxdist.methods import Method as Method
from jaxdist.methods import PipeshardParallel as PipeshardParallel
from jaxdist.methods import ShardParallel as ShardParallel
from jaxdist.methods import UniformStageOption as UniformStageOption
from jaxdist.methods import Zero2Parallel as Zero2Parallel
from jaxdist.methods import Zero3Parallel as Zero3Parallel
from jaxdist.pipeline.layers import AutoLayerOption as AutoLayerOption
from jaxdist.tune import Trial as Trial
from jaxdist.tune import TuneReport as TuneReport
from jaxdist.tune import tune as tune
from jaxdist.pipeline.layers import automatic_layer_construction as automatic_layer_construction
from jaxdist.pipeline.layers import manual_layer_construction as manual_layer_construction
from jaxdist.pipeline.layers import mark_pipeline_boundary as mark_pipeline_boundary
from jaxdist.plan import Plan as Plan

__all__ = [
    "AutoLayerOption",
    "AutoShardingOption",
    "CreateStateParallel",
    "DataParallel",
    "Estimate",
    "Executable",
    "FollowParallel",
    "LogicalMesh",
    "ManualStageOption",
    "Method",
    "ParallelizedFunc",
    "PipeshardParallel",
    "Plan",
    "ShardParallel",
    "StageEstimate",
    "Trial",
    "TuneReport",
    "UniformStageOption",
    "Zero2Parallel",
    "Zero3Parallel",
    "errors",
    "estimate",
    "grad",
    "init_distributed",
    "parallelize",
    "advise",
    "automatic_layer_construction",
    "calibrate",
    "checkpoint",
    "manual_layer_construction",
    "mark_pipeline_boundary",
    "tune",
    "value_and_grad",
]
