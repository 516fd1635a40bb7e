# The remote receiver of the wide-area trials: kickass-agent (Python) and its
# Kick-Ass receiver ka-agent-recv (Rust). Built from the repository root:
#   docker build -f docker/agent.Dockerfile -t kickass-agent .
FROM rust:1-bookworm AS rust
WORKDIR /src
COPY Cargo.toml Cargo.lock ./
COPY core/ ./core/
COPY router-edge/ ./router-edge/
COPY wan-agents/ ./wan-agents/
RUN cargo build --release -p ka-agent --bins

FROM python:3.11-slim-bookworm
WORKDIR /app
COPY core/ ./core/
COPY wan-agents/ ./wan-agents/
RUN pip install --no-cache-dir ./core ./wan-agents && rm -rf ./core ./wan-agents
COPY --from=rust /src/target/release/ka-agent-recv /usr/local/bin/ka-agent-recv
ENV PYTHONUNBUFFERED=1
# Control API, TCP flows, Kick-Ass flows (informative under host networking).
EXPOSE 8700/tcp 8701/tcp 8702/udp
ENTRYPOINT ["kickass-agent"]
CMD ["--kickass-receiver", "/usr/local/bin/ka-agent-recv", "--state-dir", "/var/lib/kickass-agent"]
