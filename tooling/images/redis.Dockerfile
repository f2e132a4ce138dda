# syntax=docker/dockerfile:1
# The chart's bundled Redis (charts/effectmq, redis.enabled) without a registry:
# Debian's redis-server on the Debian base tooling/images.sh debootstraps. What the
# chart needs of it: `redis-server` and `redis-cli` on PATH, /data writable by the
# `redis` user, uid/gid 999 (values.yaml redis.podSecurityContext).
#
# The package comes from bookworm-security, which the base's apt sources have: the fix
# for CVE-2025-49844 (Lua use-after-free, remote code execution) is in redis-server
# from 5:7.0.15-1~deb12u6, later fixes only in the security suite. An older
# redis-server fails the build. images.sh labels the image with the version it holds
# (org.opencontainers.image.version).
#
#   bash tooling/images.sh redis
ARG BASE_IMAGE=effectmq-base:bookworm
FROM ${BASE_IMAGE}
ARG REDIS_UID=999
ARG REDIS_GID=999
LABEL org.opencontainers.image.title="redis" \
      org.opencontainers.image.description="Debian's redis-server with bookworm-security's fixes, for the effectmq chart's bundled Redis"
# policy-rc.d: the package's postinst must not start a server inside the build.
RUN groupadd --system --gid "${REDIS_GID}" redis \
    && useradd --system --uid "${REDIS_UID}" --gid redis --home-dir /var/lib/redis --no-create-home \
       --shell /usr/sbin/nologin redis \
    && printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d \
    && apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools \
    && installed="$(dpkg-query -W -f='${Version}' redis-server)" fixed="5:7.0.15-1~deb12u6" \
    && if ! dpkg --compare-versions "$installed" ge "$fixed"; then \
         echo "redis-server $installed predates $fixed (CVE-2025-49844): no bookworm-security in the apt sources?" >&2; \
         exit 1; fi \
    && rm -f /usr/sbin/policy-rc.d \
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log \
    && mkdir -p /data && chown "${REDIS_UID}:${REDIS_GID}" /data
WORKDIR /data
USER ${REDIS_UID}:${REDIS_GID}
EXPOSE 6379
CMD ["redis-server"]
