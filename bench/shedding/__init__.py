"""``python -m bench.shedding``: do the load shedders keep critical requests fast under a flood?

The demo runs under gunicorn against a private Redis, restarted for each configuration of the
shedders, while this process's load generator (``bench/load.py``) sends each phase's traffic.
One module per scenario, and what runs them:

- ``flood``: critical charges beside a flood of slow exports, shedding off then on (and, with
  ``--fleet-only``, with the fleet shedder alone); the targets of the shedding issue.
- ``local_path``: issue 12's closed-loop floods (32 connections of exports, or of one abusive
  key) and what a request refused before authentication costs the workers, with the local path
  and without it.
- ``adaptive`` (``--adaptive``): fixed worker capacities against the adaptive one, while the
  exports' downstream slows down fivefold.
- ``configuration``: one gunicorn start, its environment and its phases; ``runner`` runs the
  scenarios' configurations in order, ``report`` prints what they measured, and ``__main__``
  is the command.
"""
