from services.rld.service import main

if __name__ == "__main__":
    main()
