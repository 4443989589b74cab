"""jaxdist: automatic parallelization of JAX training steps."""

from jaxdist import errors as errors
from jaxdist.api import ParallelizedFunc as ParallelizedFunc
from jaxdist.api import parallelize as parallelize
from jaxdist.executable import Executable as Executable
from jaxdist.launch import init_distributed as init_distributed
from jaxdist.mesh import LogicalMesh as LogicalMesh
from jaxdist.methods import DataParallel as DataParallel
from jaxdist.methods import Method as Method
from jaxdist.methods import Zero2Parallel as Zero2Parallel
from jaxdist.methods import Zero3Parallel as Zero3Parallel
from jaxdist.plan import Plan as Plan

__all__ = [
    "DataParallel",
    "Executable",
    "LogicalMesh",
    "Method",
    "ParallelizedFunc",
    "Plan",
    "Zero2Parallel",
    "Zero3Parallel",
    "errors",
    "init_distributed",
    "parallelize",
]
