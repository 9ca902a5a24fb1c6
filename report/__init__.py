"""backplan.report: explain() reports — the plans of a step as text, DOT and a picture.

Sits above the runtime (it reads regions and compiled-plan facts) and below the tracer, whose
compiled functions hand their traced plans to it.
"""

from backplan.runtime.wording import register

from .freed_message import freed_message
from .region_text import saved_table

register("graph_freed", freed_message)
register("region", saved_table)
