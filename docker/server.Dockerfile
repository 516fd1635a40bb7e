# The measurement server image: `kickass server`, `kickass db upgrade`, and the
# reader-role grant (docker/grant_reader.py). Built from the repository root:
#   docker build -f docker/server.Dockerfile -t kickass-server .
FROM python:3.11-slim-bookworm

# Only what the server host runs: the dependency-free core, the database
# package (its wheel carries the Alembic migrations), the server package and
# the Atlas package (its ICMP responder and ingest run beside the server).
WORKDIR /app
COPY core/ ./core/
COPY server/ ./server/
COPY db/ ./db/
COPY atlas/ ./atlas/
COPY docker/grant_reader.py ./docker/grant_reader.py
RUN pip install --no-cache-dir ./core ./db ./server ./atlas \
    && rm -rf ./core ./db ./server ./atlas

ENV PYTHONUNBUFFERED=1

# HTTP API and the UDP probe protocol (only informative under host networking).
EXPOSE 8080/tcp 9000/udp

# Root inside the container, but docker-compose.yml drops every capability
# except CAP_NET_RAW: the raw socket that writes the probes' IP headers is
# the one privilege the server needs.
ENTRYPOINT ["kickass"]
CMD ["server"]
