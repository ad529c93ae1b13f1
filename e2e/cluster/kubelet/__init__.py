"""The process kubelet: a Node whose pods run as processes of the project's image, each in a
network namespace of its own (`python -m e2e.cluster.kubelet`, started by `e2e/cluster/up` in the
checkout's virtualenv: it needs aiohttp).

`images` stays standard library only, since e2e/cluster/imagebuild.py imports it under any
python3; so this package imports nothing of its modules.
"""
