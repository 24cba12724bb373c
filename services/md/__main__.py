from services.md.service import MainDecoder
from shared.service import service_main

if __name__ == "__main__":
    service_main(MainDecoder, "md")
