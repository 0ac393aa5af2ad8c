"""What the cluster operator and local mode both read of a running job: the chief's metrics
(scrape.py) and the job's status as one pure function of what was observed (status.py).

It may use only the runtime's contract.
"""
