# The measurement server image: `kickass server`, `kickass db upgrade`, the
# reader-role grant (docker/grant_reader.py) and `kickass schedule run --loop`
# (the compose file's `schedule` service). Built from the repository root:
#   docker build -f docker/server.Dockerfile -t kickass-server .
#
# Only what the server host runs: the dependency-free core, the database
# package (its wheel carries the Alembic migrations), the server package, the
# Atlas package (its ICMP responder and ingest run beside the server), the
# analysis package (the rollups the scheduled `refresh` recomputes, the
# volunteer page) and the operations package (`kickass schedule`).
#
# Few steps after the sources: a source edit rebuilds two layers (copy,
# install), not one per package. That matters with storage drivers that copy
# the whole file system at every step (vfs), and the third-party dependencies
# stay cached in their own layer until a pyproject.toml changes.

# The packages' declared dependencies, and the sources (empty stages: cheap steps).
FROM scratch AS meta
LABEL org.kickass.image="kickass-server-stage"
COPY core/pyproject.toml /meta/core/
COPY db/pyproject.toml /meta/db/
COPY server/pyproject.toml /meta/server/
COPY atlas/pyproject.toml /meta/atlas/
COPY analysis/pyproject.toml /meta/analysis/
COPY operations/pyproject.toml /meta/operations/
COPY docker/requirements.py /meta/requirements.py

FROM scratch AS src
LABEL org.kickass.image="kickass-server-stage"
COPY core/ /src/core/
COPY db/ /src/db/
COPY server/ /src/server/
COPY atlas/ /src/atlas/
COPY analysis/ /src/analysis/
COPY operations/ /src/operations/
COPY docker/grant_reader.py /src/docker/grant_reader.py

FROM python:3.11-slim-bookworm
LABEL org.kickass.image="kickass-server"
ENV PYTHONUNBUFFERED=1
# HTTP API and the UDP probe protocol (only informative under host networking).
EXPOSE 8080/tcp 9000/udp
# Root inside the container, but docker-compose.yml drops every capability
# except CAP_NET_RAW: the raw socket that writes the probes' IP headers is
# the one privilege the server needs.
ENTRYPOINT ["kickass"]
CMD ["server"]
WORKDIR /app

# Third-party dependencies first, read from the packages' pyproject.toml only.
COPY --from=meta /meta /tmp/meta
RUN python /tmp/meta/requirements.py /tmp/meta/*/pyproject.toml > /tmp/requirements.txt \
    && pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm -rf /tmp/meta /tmp/requirements.txt

# The workspace packages themselves: their dependencies are all above, and
# pip check fails the build if one is missing.
COPY --from=src /src /tmp/src
RUN cd /tmp/src \
    && pip install --no-cache-dir --no-deps --no-build-isolation \
        ./core ./db ./server ./atlas ./analysis ./operations \
    && pip check \
    && install -D -m 0644 docker/grant_reader.py /app/docker/grant_reader.py \
    && cd / && rm -rf /tmp/src
