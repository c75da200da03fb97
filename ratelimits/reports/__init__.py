"""Usage read for people: the admin's usage report and the daily "near limit" digest.

- :mod:`.queries`, :mod:`.chart`, :mod:`.text` and :mod:`.report`: the admin's usage report
  (its form, tables, chart and CSV files).
- :mod:`.digest`: the digest mailed to the site's admins.

They read what :mod:`ratelimits.usage` recorded, through its one reader of usage, so the report,
``GET /v1/usage`` and ``/v1/rate_limit`` agree.
"""
