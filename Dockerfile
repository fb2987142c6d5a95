FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md LICENSE ./
COPY gateway ./gateway
COPY adapters ./adapters
COPY examples ./examples
COPY config ./config
RUN pip install --no-cache-dir '.[fast]'
# the state file's home; a named volume mounted here starts with this owner
RUN mkdir -p /var/lib/fencegate && chown nobody:nogroup /var/lib/fencegate
USER nobody
EXPOSE 8080
ENTRYPOINT ["fencegate"]
CMD ["serve", "--config", "/etc/fencegate/fencegate.toml"]
