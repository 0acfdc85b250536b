"""What the demo, the tests and the benchmarks need on a machine without a cluster, and no
job needs on one: a local S3 endpoint on loopback (`devtools.local_s3`) and a local Ray
cluster (`devtools.local_ray`).
"""
