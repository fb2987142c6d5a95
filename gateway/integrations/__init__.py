"""Job-framework integrations: where a job's generation comes from when a framework hands out
the work. Each module is an optional extra (``fencegate[arq]``, ``fencegate[celery]``,
``fencegate[postgres]``, ``fencegate[procrastinate]``) and uses only the SDK
(:mod:`gateway.client`) and its framework; importing this package needs none of them.

- :mod:`gateway.integrations.arq`: a task wrapper and a worker class for arq; the generation
  is arq's ``job_try``.
- :mod:`gateway.integrations.celery`: a task base class for Celery; each run allocates the
  next generation (Celery has no per-delivery counter), a superseded run is ignored.
- :mod:`gateway.integrations.postgres`: claim a row of a job table with ``SKIP LOCKED``,
  register its attempt, commit only if the attempt still holds (psycopg 3).
- :mod:`gateway.integrations.procrastinate`: a task middleware for Procrastinate; the
  generation is the job's ``attempts + 1``, and its finish and retry apply only while the
  row still holds the attempt.
"""
