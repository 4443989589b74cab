"""Progressive method tuning: ``jaxdist.tune`` walks the methods and reports them."""

from jaxdist.tune.report import Trial as Trial
from jaxdist.tune.report import TuneReport as TuneReport
from jaxdist.tune.walk import tune as tune
