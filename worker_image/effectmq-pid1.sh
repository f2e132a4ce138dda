#!/bin/sh
# `effectmq` as a container's first process runs under tini.
#
# The first process of a container is PID 1, and the kernel drops every signal PID 1
# has no handler for: a SIGTERM that reached `effectmq worker` before Python had
# installed its handler (its first half second or so) was lost, and the pod went on
# taking tasks until the kubelet's SIGKILL at the end of the grace period. tini as
# PID 1 forwards the signal to the worker, which stops at any moment of its start,
# and reaps zombies of handler subprocesses.
#
# The image puts this script first on PATH as `effectmq`, so tini runs whether the
# container starts from the image's ENTRYPOINT or from a `command: [effectmq, ...]`
# that replaces it (the operator's worker Deployment sets one). Not PID 1
# (`kubectl exec`, `docker run --init`): the runtime's own effectmq, unchanged.
if [ "$$" = 1 ] && command -v tini >/dev/null 2>&1; then
    exec tini -- /opt/effectmq/bin/effectmq "$@"
fi
exec /opt/effectmq/bin/effectmq "$@"
