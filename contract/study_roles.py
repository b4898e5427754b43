"""The parts backend profiles play in a study (`kvscope demo`), by profile name.

The study runs these profiles and its readers (analysis.study_*) single them out: speedups are
over the baseline, verdicts are about the candidate, and the targets put the candidate beside
the classic path. Both sides name them from here, so a reader never imports the study's options
to know which run is which.
"""

from __future__ import annotations

BASELINE = "kvscope-serial"
CANDIDATE = "kvscope"
CLASSIC = "kvscope-classic"  # the parallel path before issue 24, beside the new one
