"""Local mode, `distbelief run`: a job's rendered pods as processes on this machine
(local.py drives a run; localpods.py starts the pods; podusage.py watches their memory and
traffic), the checks before any pod starts (preflight.py), the output folder
(outputdir.py), the live status `kubectl distbelief --local` reads (livestatus.py), the
progress bar and the report (report.py), and the training curves (curves.py).

It may use render, status and spec, and the runtime's roles and models (it checks the
data and the model before any pod starts).
"""
